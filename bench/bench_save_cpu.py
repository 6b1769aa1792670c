#!/usr/bin/env python3
"""The checkpoint writer's CPU seconds per save, by phase: through the page cache (torch.save into
a buffered file, as every save wrote before) against straight from the shared buffer to the disk
(worker/direct_sink.py, what the async writer process does now).

On a CPU run both cores train, so every CPU second the writer spends is taken from a rank, and
the other rank waits for it at the next all-reduce; CPU seconds, unlike wall times, hold still
under a shared machine's load. This process plays the writer (one thread: its `process_time`
is the writer's user + system time) on the debug preset's state (its parameters and AdamW's two
moments: 155 MB), the two paths interleaved (A B A B), each save a fresh file, the previous one
removed (as keep_last does). Phases:

- copy: the loop's copy of the state into the shared buffer (SnapshotTaker.take; the loop's part,
  not the writer's; the same for both paths, shown once per save);
- rebuild: the writer's state from the buffer (its skeleton unpickled);
- serialize+hash+write: torch.save through the sink, every byte hashed (sha256) and written;
- fsync: the file's and its directory's (os.fsync, timed where it is called);
- publish: manifest, rename.

Beside it, the whole machine's busy CPU seconds over the save (/proc/stat: every core, the
kernel's writeback threads included, and whatever else runs on a shared machine: an upper bound).

    PYTHONPATH=. python bench/bench_save_cpu.py [--quick]
Writes bench/results/save_cpu.md and bench/results/save_cpu.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.compare import Comparison, Side, write_results  # noqa: E402
from gpuherd.config import resolve  # noqa: E402
from gpuherd.model_size import checkpoint_bytes  # noqa: E402
import worker.checkpoint_io as checkpoint_io  # noqa: E402
from worker.checkpoint_io import directly_to_disk, save_checkpoint_file  # noqa: E402
from worker.model import ModelArgs, Transformer  # noqa: E402
from worker.save_snapshot import SnapshotTaker, rebuild, reserve_bytes  # noqa: E402

VOCAB = 50257  # the debug preset's dummy data uses the GPT-2 vocabulary
PHASES = ("rebuild", "serialize+hash+write", "fsync", "publish")
PATHS = {"direct": directly_to_disk, "page cache": None}


def debug_state() -> tuple[dict, int]:
    """The debug preset's model after one AdamW step: what a save of the DDP run holds."""
    cfg = resolve("debug", overrides=["system.device=cpu"])
    model = Transformer(ModelArgs.from_config(cfg.model, VOCAB, cfg.data.context_length))
    model.init_weights(0, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, VOCAB, (1, 16))).float().mean().backward()
    optimizer.step()
    n_params = sum(p.numel() for p in model.parameters())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "optimizer_format": "bench"}, n_params


def busy_seconds() -> float:
    """Every core's non-idle seconds since boot (/proc/stat's first line)."""
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


class PhaseClock:
    """CPU seconds of this process per phase; os.fsync is wrapped so its calls inside the save
    are a phase of their own."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._fsync = os.fsync
        os.fsync = self._timed_fsync

    def _timed_fsync(self, fd: int) -> None:
        started = time.process_time()
        self._fsync(fd)
        self.cpu["fsync"] += time.process_time() - started

    def restore(self) -> None:
        os.fsync = self._fsync


def one_save(taker: SnapshotTaker, state: dict, path: Path, step: int, scope: Callable | None) -> dict[str, float]:
    clock = PhaseClock()
    try:
        started = time.process_time()
        snapshot = taker.take({"meta": {"step": step, "run_id": "bench"}, "states": state})
        copy = time.process_time() - started
        machine, wall = busy_seconds(), time.perf_counter()
        started = time.process_time()
        built = rebuild(snapshot, taker.region.map)
        clock.cpu["rebuild"] = time.process_time() - started
        started = time.process_time()
        written: list[tuple[float, float]] = []  # at the manifest: the file is complete and fsynced
        write_manifest = checkpoint_io.write_manifest
        checkpoint_io.write_manifest = lambda *a: (written.append((time.process_time(), clock.cpu["fsync"])),
                                                   write_manifest(*a))
        try:
            obj = {"format": "gpuherd/full-v1", **built["states"], "meta": built["meta"]}
            with scope() if scope is not None else contextlib.nullcontext():
                save_checkpoint_file(obj, path)
        finally:
            checkpoint_io.write_manifest = write_manifest
        ended = time.process_time()
        (complete, file_fsync), = written
        clock.cpu["serialize+hash+write"] = complete - started - file_fsync
        clock.cpu["publish"] = ended - complete - (clock.cpu["fsync"] - file_fsync)
        total = ended - started + clock.cpu["rebuild"]
        return {"copy": copy, **clock.cpu, "total": total, "machine": busy_seconds() - machine,
                "wall": time.perf_counter() - wall}
    finally:
        clock.restore()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 saves per path instead of 8")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir under bench/)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one rank's share of a 2-core machine
    saves = 4 if args.quick else 8
    state, n_params = debug_state()
    expected = checkpoint_bytes(n_params)
    taker = SnapshotTaker(torch.device("cpu"), reserve_bytes(expected, 2), expected)
    taker.region.populate(expected)  # as the writer does at its start
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in PATHS}
    with tempfile.TemporaryDirectory(dir=args.dir or REPO / "bench", prefix=".save-cpu-") as tmp:
        previous: dict[str, Path] = {}
        for i in range(saves):
            for name in (list(PATHS) if i % 2 == 0 else list(reversed(PATHS))):
                path = Path(tmp) / f"{name.replace(' ', '_')}_{i:07d}.pt"
                rows[name].append(one_save(taker, state, path, i, PATHS[name]))
                size = path.stat().st_size
                back = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                assert torch.equal(back["model"]["output.weight"], state["model"]["output.weight"])
                del back
                if name in previous:  # keep_last: the older file goes, its page cache with it
                    previous[name].unlink()
                    previous[name].with_name(previous[name].name + ".manifest.json").unlink()
                previous[name] = path
    taker.close()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    comparisons = [Comparison(f"the writer's CPU seconds per save, {what}", "s",
                              Side("direct", [r[what] for r in rows["direct"]]),
                              Side("page cache", [r[what] for r in rows["page cache"]]))
                   for what in ("total", *PHASES)]
    comparisons.append(Comparison("the whole machine's busy CPU seconds over the write (upper bound)", "s",
                                  Side("direct", [r["machine"] for r in rows["direct"]]),
                                  Side("page cache", [r["machine"] for r in rows["page cache"]])))
    notes = [f"{saves} saves per path of {size / 1e6:.0f} MB (debug preset, {n_params / 1e6:.1f}M parameters with "
             f"AdamW), interleaved; the loop's copy into the shared buffer: median {med['direct']['copy']:.3f} s of "
             f"CPU, the run's first {rows['direct'][0]['copy']:.3f} s; wall per write (median): direct "
             f"{med['direct']['wall']:.2f} s, page cache {med['page cache']['wall']:.2f} s.",
             "Per save, in order (total CPU s): " + "; ".join(
                 f"{name}: " + ", ".join(f"{r['total']:.3f}" for r in rs) for name, rs in rows.items())]
    write_results("save_cpu", "The checkpoint writer's CPU per save: straight from the buffer vs through the page "
                  "cache", comparisons, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
