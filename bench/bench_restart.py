#!/usr/bin/env python3
"""Restart-to-first-step: rank 1 of 2 is killed (SIGKILL) at step 40; seconds until rank 0
of the restarted workers has finished its first step (an all_reduce with rank 1: the new
process group works).

The same gloo worker (bench/blame_worker.py) under gpuherd (`--max-restarts 1`, default
backoff), NVIDIA's ft_launcher and torchrun (`--max-restarts 1 --standalone`), round
robin. A restart that never reaches its first step within the cap is counted as failed
and left out of the times. Writes bench/results/restart.md.

    python3 bench/bench_restart.py [--quick] [--cap S]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import Comparison, Side, write_results  # noqa: E402
from bench.launchers import Launchers, kill_tree, worker_env  # noqa: E402

WORKER = ROOT / "bench" / "blame_worker.py"
KINDS = ("gpuherd", "ft_launcher", "torchrun")


def command(ln: Launchers, kind: str, out: Path) -> list[str]:
    if kind == "gpuherd":
        return ln.gpuherd(2, str(out), "restart", flags=("--max-restarts", "1"))
    launch = ln.ft_launcher if kind == "ft_launcher" else ln.torchrun
    return launch(2, str(out), "restart", flags=("--standalone", "--max-restarts", "1"))


def restart(ln: Launchers, kind: str, cap: float) -> float | None:
    """Seconds from the kill to the restarted rank 0's first step; None if it never got there."""
    out = Path(tempfile.mkdtemp(dir=ln.work))
    proc = subprocess.Popen(command(ln, kind, out), env=worker_env(), cwd=ln.work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + cap
        while not (out / "first-step").exists():
            if time.monotonic() > deadline or (proc.poll() is not None and not (out / "first-step").exists()):
                return None
            time.sleep(0.01)
        time.sleep(0.02)  # written in one go right after the step
        return float((out / "first-step").read_text()) - float((out / "killed").read_text())
    finally:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 6")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds a restart may take (default 60)")
    args = parser.parse_args()
    rounds = 3 if args.quick else 6
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    failed = dict.fromkeys(KINDS, 0)
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        ln = Launchers(Path(tmp), WORKER, grace_period=2)
        for i in range(rounds):
            for kind in KINDS[i % 3:] + KINDS[:i % 3]:
                seconds = restart(ln, kind, args.cap)
                if seconds is None:
                    failed[kind] += 1
                else:
                    samples[kind].append(seconds)
    gpuherd = Side("gpuherd", samples["gpuherd"] or [float("nan")])
    comparisons = [Comparison(f"SIGKILL -> first step of the restarted workers: vs {kind}", "s", gpuherd,
                              Side(kind, samples[kind] or [float("nan")])) for kind in KINDS[1:]]
    write_results("restart", "Restart to first step (max restarts 1)", comparisons, notes=[
        f"{rounds} round-robin rounds; restarts that never reached a first step within {args.cap:g} s: "
        + ", ".join(f"{kind} {failed[kind]} of {rounds}" for kind in KINDS) + ".",
        "gpuherd: default backoff (0.2 s), a fresh TCPStore for the new attempt served by the store helper that "
        "stayed up (no second torch import); torchrun/ft_launcher: their c10d rendezvous (--standalone).",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
