#!/usr/bin/env python3
"""`gpuherd top` and `gpuherd report` on a 2,048-rank run: seconds and peak memory.

A run directory is synthesized with the files a real run writes, in their real formats
(gpuherd/status_channel.py records as the built-in worker sends them, the supervisor's GPU
and host samples, config.json, summary.json, one worker log name per rank): 2,048 ranks, one
GPU each (the most series a view can meet), every rank logging its step line, liveness `alive` records, a GPU sample and a
host sample per rank every few seconds, checkpoints from every rank, one failed rank, three
slow ones. Each view runs in a fresh process (its own peak RSS, no warm caches), and is
compared side by side, interleaved, with itself on an 8-rank run of the same length: the
ratio says how the cost grows with the ranks. `top` is also compared with its every-rank
table (`--all-ranks`) on the same 2,048-rank run.

    python3 bench/bench_views.py [--quick]     (python -m bench --only views)
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import Comparison, Side, write_results  # noqa: E402

T0 = 1_790_000_000.0  # the run's start, unix seconds
SAMPLE_S = 5.0  # GPU/host samples and liveness records: one per rank every 5 s
STEP_S = 2.0  # one logged step every 2 s
CONFIG = {"preset": "production", "training": {"batch_size": 4, "grad_accum_nums": 2, "max_steps": 100_000,
                                               "learning_rate": 3e-4, "strategy": "fsdp"},
          "data": {"context_length": 2048, "dataset": "fineweb"}, "model": {"dim": 4096, "n_layers": 32},
          "system": {"max_restarts": 0}}
FAILED_RANK = 1234
SLOW_RANKS = (17, 700, 1999)


def synthesize(run_dir: Path, ranks: int, steps: int) -> int:
    """A finished run of `ranks` ranks and `steps` logged steps each; returns metrics.jsonl's bytes."""
    failed = FAILED_RANK % ranks
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_bytes(orjson.dumps(CONFIG))
    for rank in range(ranks):
        (run_dir / f"worker-rank{rank}-GPU{rank}.log").touch()
    size = 0
    with (run_dir / "metrics.jsonl").open("wb") as out:
        for rank in range(ranks):
            out.write(orjson.dumps({"type": "ready", "rank": rank, "time": T0 + 1, "device": f"cuda:{rank}",
                                    "uuid": f"GPU-{rank:08x}", "pid": 100_000 + rank}) + b"\n")
        for i in range(steps):
            now = T0 + 10 + i * STEP_S
            lines = []
            for rank in range(ranks):
                slow = 1.6 if rank in SLOW_RANKS else 1.0
                lines.append({"type": "step", "rank": rank, "time": now + rank * 1e-4, "step": i * 10,
                              "max_steps": 100_000, "loss": 11.0 - i * 0.01 + rank * 1e-6, "lr": 3e-4,
                              "grad_norm": 1.2, "tokens_per_s": 8192 / slow, "mfu": 0.41 / slow,
                              "mem_bytes": 60 << 30})
                if i % int(SAMPLE_S / STEP_S) == 0:
                    lines.append({"type": "alive", "rank": rank, "time": now + 0.5, "phase": "train", "step": i * 10,
                                  "for_s": i * STEP_S, "where": "forward/backward", "where_s": 0.3,
                                  "collective": None, "steps": 2, "compute_s": 1.6, "wait_s": 0.3})
                    lines.append({"type": "gpu", "time": now + 1, "gpu": rank, "uuid": f"GPU-{rank:08x}",
                                  "rank": rank, "util": 97, "mem_used": 61 << 30, "mem_total": 80 << 30,
                                  "temp": 64 + rank % 7, "temp_slowdown": 87, "sm_clock_mhz": 1980, "power_w": 640.5,
                                  "power_limit_w": 700.0, "clock_events": [], "ecc_corrected": 0,
                                  "ecc_uncorrected": 0})
                    lines.append({"type": "host", "time": now + 1, "rank": rank, "pid": 100_000 + rank,
                                  "cpu_percent": 101.0, "rss": 9 << 30, "threads": 40})
                if i and i % 50 == 0:
                    lines.append({"type": "checkpoint", "rank": rank, "time": now + 1.5, "step": i * 10,
                                  "path": f"/ckpt/step_{i * 10:07d}.pt", "stall_s": 0.8, "wait_s": 0.0,
                                  "write_s": 21.0, "mode": "async"})
            block = b"".join(orjson.dumps(r) + b"\n" for r in lines)
            size += len(block)
            out.write(block)
        end = T0 + 10 + steps * STEP_S
        tail = [{"type": "error", "rank": failed, "time": end, "message": "RuntimeError: CUDA error: an illegal "
                 "memory access was encountered", "exit_code": 1}]
        tail += [{"type": "done", "rank": r, "time": end + 1, "step": steps * 10} for r in range(ranks) if r != failed]
        block = b"".join(orjson.dumps(r) + b"\n" for r in tail)
        out.write(block)
        size += len(block)
    (run_dir / "summary.json").write_bytes(orjson.dumps({
        "run_id": run_dir.name, "exit_code": 1, "outcome": "worker-exit", "duration_s": end + 5 - T0,
        "started_at": datetime.datetime.fromtimestamp(T0, datetime.timezone.utc).isoformat(), "max_restarts": 0, "restarts": 0,
        "root_cause": {"rank": failed, "message": f"GPU{failed} (rank {failed}) exit code 1"},
        "workers": [{"rank": r, "role": "first-failure" if r == failed else "victim",
                     "ended": "exit code 1" if r == failed else "killed by SIGTERM"} for r in range(ranks)]}))
    return size


_MEASURE = """
import io, resource, sys, time
from contextlib import redirect_stdout
t0 = time.perf_counter()
view, run_dir, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
out = io.StringIO()
with redirect_stdout(out):
    if view == "top":
        from supervisor.commands.top import main
        code = main([run_dir, "--once", "--width", "200", *extra])
    else:
        from supervisor.commands.report import main
        code = main([run_dir, "--out", run_dir + "/report-bench"])
assert code == 0, out.getvalue()[-2000:]
print(time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(out.getvalue()))
"""


def measure(view: str, run_dir: Path, *extra: str) -> tuple[float, float, int]:
    """(seconds, peak RSS in MiB, characters printed) of one view in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _MEASURE, view, str(run_dir), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{view} failed: {proc.stderr[-3000:]}")
    seconds, rss, printed = proc.stdout.split()
    return float(seconds), float(rss), int(printed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run and fewer repetitions")
    args = parser.parse_args()
    steps, repeats = (40, 2) if args.quick else (100, 3)
    with tempfile.TemporaryDirectory(prefix="gpuherd-views-") as tmp:
        big, small = Path(tmp) / "run-2048", Path(tmp) / "run-8"
        started = time.perf_counter()
        size = synthesize(big, 2048, steps)
        synthesize(small, 8, steps)
        made = time.perf_counter() - started
        records = sum(1 for _ in (big / "metrics.jsonl").open("rb"))
        comparisons, figures = [], {}
        for view, extra in (("top", ()), ("report", ())):
            sides = {n: (Side(n, []), Side(n, [])) for n in ("2,048 ranks", "8 ranks")}
            for i in range(repeats):
                order = ((big, "2,048 ranks"), (small, "8 ranks"))
                for run_dir, name in order if i % 2 == 0 else order[::-1]:
                    seconds, rss, printed = measure(view, run_dir, *extra)
                    sides[name][0].samples.append(seconds)
                    sides[name][1].samples.append(rss)
                    figures[(view, name)] = printed
            label = f"`gpuherd {view}{' --once' if view == 'top' else ''}`"
            comparisons.append(Comparison(f"{label}: seconds", "s", sides["2,048 ranks"][0], sides["8 ranks"][0]))
            comparisons.append(Comparison(f"{label}: peak RSS", "MiB", sides["2,048 ranks"][1], sides["8 ranks"][1]))
        every = Side("every-rank table", [])
        grouped = Side("2,048 ranks", [])
        for i in range(repeats):
            for side, extra in ((grouped, ()), (every, ("--all-ranks",)))[:: 1 if i % 2 == 0 else -1]:
                seconds, _rss, printed = measure("top", big, *extra)
                side.samples.append(seconds)
                figures[("top", side.name)] = printed
        comparisons.append(Comparison("`gpuherd top --once` on 2,048 ranks: grouped frame vs `--all-ranks`", "s",
                                      grouped, every))
    write_results("views", "gpuherd top / report at 2,048 ranks (ratios: the 8-rank run's cost over the "
                           "2,048-rank run's, or the every-rank table's over the grouped frame's)", comparisons, notes=[
        f"synthesized run: 2,048 ranks, one GPU and one worker log each, {steps} logged steps per rank, one GPU "
        f"sample, host sample and liveness record per rank every {SAMPLE_S:.0f} s, a checkpoint every 50 steps from "
        f"every rank: {records:,} records, {size / 2**20:.0f} MiB of metrics.jsonl (made in {made:.0f} s); the 8-rank "
        "run has the same length",
        f"`top --once` prints {figures[('top', '2,048 ranks')]:,} characters on 2,048 ranks "
        f"({figures[('top', '8 ranks')]:,} on 8); with `--all-ranks` {figures[('top', 'every-rank table')]:,}",
        "each view in a fresh process: its whole run from start (imports included) to its exit; peak RSS is the "
        f"process's ru_maxrss; {repeats} interleaved repetitions",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
