#!/usr/bin/env python3
"""Live recovery vs torchft's and ft_launcher's: one of 2 data-parallel workers is SIGKILLed
mid-run; seconds from the kill to the next completed step, the three interleaved in each round.

- gpuherd live: the built-in trainer (tiny Llama, DDP over gloo, 2 ranks; bench_live_recovery.py's
  run): a warm spare takes rank 1, rank 0 keeps its process, nothing is redone, the full global
  batch at every step.
- torchft: the same model, config, data slots and optimizer (bench/torchft_worker.py) as 2 replica
  groups of 1 rank, each under its own `torchrun --max-restarts 1`, a lighthouse with the settings
  torchft's README gives (`--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`, its
  default 5 s heartbeat timeout). Two figures: (a) the surviving group's next committed step,
  which it takes alone, on half the global batch (the lost group's samples of those steps are
  never trained: torchft is lossy while a group is missing); (b) the restarted group's first step
  contributing again (healed from the survivor, the full batch back).
- ft_launcher restart: NVIDIA's launcher restarting every worker (bench_restart.py's worker and
  measure, as bench_live_recovery.py).

torchft is optional, never a dependency of gpuherd: without it its rows are skipped, with one line
saying how to install it. Writes bench/results/live_recovery_torchft.md.

    python3 bench/bench_live_recovery_torchft.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_live_recovery import KILL_AT, TINY, trained  # noqa: E402
from bench.bench_restart import restart as launcher_restart  # noqa: E402
from bench.compare import Comparison, Tally, rotated, write_results  # noqa: E402
from bench.launchers import Launchers, kill_tree, run_records, worker_env  # noqa: E402

WORKER = ROOT / "bench" / "torchft_worker.py"
PRESET = "debug"  # bench_live_recovery.py's gpuherd runs: `--debug` and the TINY items
INSTALL = ("torchft is not installed: its rows are skipped (Linux: pip install --no-deps "
           "torchft-nightly==2026.10.26, next to opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)")
# torchft's README: `torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000`
LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
# what the `torchft_lighthouse` script starts, through torchft's Python API (that script reads the
# process's own command line, and pip may have put it off PATH); it serves while `server` holds it
LIGHTHOUSE_MAIN = ("import sys, threading, orjson; from torchft.coordination import LighthouseServer; "
                   "server = LighthouseServer(bind=sys.argv[1], **orjson.loads(sys.argv[2])); threading.Event().wait()")


@dataclass(frozen=True)
class TorchftRecovery:
    survivor: float  # kill -> the surviving group's next committed step (alone: half the global batch)
    full: float  # kill -> the restarted group's first committed step it contributed to (the full batch)
    shrunk_steps: int  # steps the survivor committed alone in between
    step_s: float | None  # the survivor's median step before the kill (its first two left out)


def torchft_available() -> bool:
    return importlib.util.find_spec("torchft") is not None


def prepare_data(work: Path) -> Path:
    """The dummy-dataset cache the gpuherd runs build, built once for every torchft run."""
    from dataset_cache import prepare_cache
    from gpuherd.config import resolve

    return prepare_cache(resolve(PRESET, overrides=[*TINY, f"data.cache_dir={work / 'cache'}"]).data).path


def _steps(out: Path) -> list[dict]:
    return [r for g in (0, 1) for r in run_records(out / f"group{g}.jsonl") if r["type"] == "step"]


def _back(r: dict) -> bool:
    """A step of the restarted group 1 that the full batch trained: both groups' gradients in it."""
    return r["group"] == 1 and r["attempt"] > 0 and r["committed"] and r["participating"] and r["participants"] == 2


def recovery(steps: list[dict], killed: float) -> TorchftRecovery | None:
    """The figures of one torchft run from both groups' step records (torchft_worker.py) and the
    time of the kill; None if either group never got there."""
    back = [r for r in steps if _back(r)]
    # a step group 0 started after the kill: one in flight then may still have been committed
    # with group 1's gradients, which is no recovery
    after = [r for r in steps if r["group"] == 0 and r["committed"] and r["start"] > killed]
    if not back or not after:
        return None
    full = min(r["time"] for r in back)
    alone = sum(r["participants"] == 1 and r["time"] < full for r in after)
    return TorchftRecovery(min(r["time"] for r in after) - killed, full - killed, alone,
                           _median_step([r["time"] for r in steps if r["group"] == 0 and r["time"] < killed]))


def _median_step(times: list[float]) -> float | None:
    """The median interval between steps that completed at `times`, the first two left out (they
    are no typical step), or None."""
    times = sorted(times)[2:]
    return statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else None


@contextlib.contextmanager
def lighthouse(work: Path, cap: float = 120) -> Iterator[str]:
    """torchft's lighthouse in a process of its own, its log in work/lighthouse.log: its address."""
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        port = probe.getsockname()[1]
    with (work / "lighthouse.log").open("wb") as log:
        cmd = [sys.executable, "-c", LIGHTHOUSE_MAIN, f"[::]:{port}", orjson.dumps(LIGHTHOUSE)]
        proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + cap
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("localhost", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://localhost:{port}"
    finally:
        kill_tree(proc)


def _wait(out: Path, procs: list[subprocess.Popen], deadline: float, done) -> bool:
    while not any(done(r) for r in _steps(out)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            return False
        time.sleep(0.01)
    return True


def torchft_recovery(work: Path, cache: Path, cap: float = 300) -> TorchftRecovery | None:
    """Both groups train until group 1, in the full quorum, reaches step KILL_AT; its worker is
    SIGKILLed; torchrun restarts it and it heals from group 0. None if that never completes."""
    out = work / "out"
    out.mkdir(parents=True)
    procs = []
    with contextlib.ExitStack() as stack:
        env = {**worker_env(), "TORCHFT_LIGHTHOUSE": stack.enter_context(lighthouse(work)), "NUM_REPLICA_GROUPS": "2"}
        stack.callback(lambda: [kill_tree(p) for p in procs if p.poll() is None])
        for group in (0, 1):
            cmd = Launchers(work / f"group{group}", WORKER, grace_period=2).torchrun(
                1, str(out), str(cache), PRESET, *TINY, flags=("--standalone", "--max-restarts", "1"))
            with (work / f"group{group}.log").open("wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=work, env={**env, "REPLICA_GROUP_ID": str(group)},
                                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + cap
        if not _wait(out, procs, deadline, lambda r: r["group"] == 1 and r["step"] >= KILL_AT and r["committed"]
                     and r["participants"] == 2):
            return None
        victim = [r["pid"] for r in run_records(out / "group1.jsonl") if r["type"] == "ready"][-1]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        if not _wait(out, procs, deadline, _back):
            return None
        return recovery(_steps(out), killed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 4")
    args = parser.parse_args()
    rounds, with_torchft = (2 if args.quick else 4), torchft_available()
    if not with_torchft:
        print(f"bench: {INSTALL}", file=sys.stderr)
    tally = Tally()
    shrunk: list[int] = []
    step_s: dict[str, list[float]] = {}  # each side's median step before the kill, per run

    with tempfile.TemporaryDirectory(prefix="bench-live-torchft-") as tmp:
        cache = prepare_data(Path(tmp)) if with_torchft else None
        ln = Launchers(Path(tmp), ROOT / "bench" / "blame_worker.py", grace_period=2)

        def gpuherd() -> None:
            got = trained(Path(tempfile.mkdtemp(dir=tmp)), 2, "cpu", True)
            tally.add("gpuherd live", None if got is None else got[0])
            if got is not None and (step := _median_step([r["time"] for r in got[2] if r.get("type") == "step"
                                                         and r["rank"] == 0 and r["step"] < KILL_AT])):
                step_s.setdefault("gpuherd live", []).append(step)

        def torchft() -> None:
            got = torchft_side(Path(tempfile.mkdtemp(dir=tmp)), cache, tally)
            if got is not None:
                shrunk.append(got.shrunk_steps)
                step_s.setdefault("torchft", []).extend([got.step_s] if got.step_s else [])

        sides = [gpuherd, lambda: tally.add("ft_launcher", launcher_restart(ln, "ft_launcher", 120.0))]
        load = rotated(sides + ([torchft] if with_torchft else []), rounds)
    _write(tally, shrunk, rounds, with_torchft, load, step_s)
    return 0


def torchft_side(work: Path, cache: Path, tally: Tally) -> TorchftRecovery | None:
    """One torchft run, its two figures added to `tally` (a run that did not finish counts
    against both)."""
    got = torchft_recovery(work, cache)
    tally.add("torchft survivor", None if got is None else got.survivor)
    tally.add("torchft full batch", None if got is None else got.full)
    return got


def _write(tally: Tally, shrunk: list[int], rounds: int, with_torchft: bool, load: list[float],
           step_s: dict[str, list[float]]) -> None:
    live = tally.side("gpuherd live")
    what = "cpu, 2 ranks: kill -> next completed step"
    comparisons = [Comparison(f"{what}, vs ft_launcher's restart of every worker", "s", live,
                              tally.side("ft_launcher"))]
    notes = [f"{rounds} rounds, the sides rotating; runs that did not finish: {tally.unfinished()}.",
             f"1-minute load average over the run (2 cores, shared): {min(load):.1f}–{max(load):.1f}; the "
             "figures are indications. Median step before the kill, per run: " + "; ".join(
                 f"{key} {', '.join(f'{v:.2f}' for v in values)} s" for key, values in sorted(step_s.items())) + ".",
             f"gpuherd: bench_live_recovery.py's run (`--debug`, tiny model, kill at step {KILL_AT}), its first "
             "step of the replacement: the full global batch, 0 steps redone, no sample skipped; ft_launcher: "
             "bench_restart.py's worker, which keeps no checkpoint and trains its 40 steps again."]
    if with_torchft:
        comparisons = [
            Comparison(f"{what} at the full global batch, vs torchft's restarted group contributing again", "s",
                       live, tally.side("torchft full batch")),
            Comparison(f"{what}, vs torchft's surviving group's next step (half the global batch: lossy)", "s",
                       live, tally.side("torchft survivor")),
            *comparisons]
        notes += [
            f"torchft-nightly {importlib.metadata.version('torchft-nightly')}: 2 replica groups of 1 rank "
            "(bench/torchft_worker.py: Manager, its DDP and Optimizer wrappers, ProcessGroupGloo), each under "
            f"`torchrun --standalone --max-restarts 1`, a lighthouse with {LIGHTHOUSE} (torchft's README) and "
            f"its default 5 s heartbeat timeout; group 1's worker SIGKILLed at manager step {KILL_AT}.",
            f"torchft steps the survivor committed alone before the full batch came back: {sorted(shrunk)}; each "
            "trained half the global batch, and group 1's slot of samples for it is never trained. The "
            "restarted group heals the model and optimizer state from the survivor (0 steps redone) but its "
            "data loader starts over (torchft leaves checkpointing it to the user).",
            "torchft's survivor waits for the lighthouse to give up on the killed group's heartbeat (its "
            "quorum refuses to form with half of the groups it believes alive, against a split brain).",
        ]
    else:
        notes.append(INSTALL + ".")
    write_results("live_recovery_torchft", "Live recovery vs torchft's and ft_launcher's (1 of 2 SIGKILLed)",
                  comparisons, notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())
