#!/usr/bin/env python3
"""Multi-node live recovery vs the job-wide restart: a job of N localhost nodes (`--nnodes N`,
one CPU worker each, gloo); rank 1, on node 1, is killed (SIGKILL) mid-run; seconds from the
kill to the next completed training step, and completed steps trained again.

- gpuherd live: `--max-restarts 1` (one warm spare per node by default): node 1 claims the
  rebuilt group on the job store and its spare takes rank 1; every other node's worker keeps
  its process and hands the state over by broadcast, no checkpoint read.
- gpuherd restart: the same job with `--spares 0`, a checkpoint every 10 steps: every node
  restarts its workers and resumes the newest checkpoint.

Rounds alternate the sides. Writes bench/results/multinode_live.md.

    python3 bench/bench_multinode_live.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_live_recovery import KILL_AT  # noqa: E402
from bench.bench_recovery_cases import Case, recovered  # noqa: E402
from bench.compare import Comparison, Side, write_results  # noqa: E402


def trained(work: Path, nnodes: int, live: bool) -> tuple[float, int] | None:
    """(seconds from the kill to the next completed step, completed steps trained again), or None."""
    flags = () if live else ("--spares", "0")
    return recovered(Case("multi-node", nnodes=nnodes, nproc=1, flags=flags), work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round instead of 2")
    args = parser.parse_args()
    rounds, nnodes = (1 if args.quick else 2), 2
    seconds: dict[str, list[float]] = {}
    redone: dict[str, list[int]] = {}
    failed: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mnlive-") as tmp:
        for i in range(rounds):
            for live in ((True, False) if i % 2 == 0 else (False, True)):
                key = "gpuherd live" if live else "gpuherd restart"
                got = trained(Path(tempfile.mkdtemp(dir=tmp)), nnodes, live)
                failed[key] = failed.get(key, 0) + (got is None)
                if got is not None:
                    seconds.setdefault(key, []).append(got[0])
                    redone.setdefault(key, []).append(got[1])
    sides = [Side(key, seconds.get(key) or [float("nan")]) for key in ("gpuherd live", "gpuherd restart")]
    steps = "; ".join(f"{key}: {sorted(values)}" for key, values in sorted(redone.items()))
    write_results("multinode_live", f"Multi-node live recovery vs the job-wide restart ({nnodes} localhost nodes, "
                  "rank 1 on node 1 SIGKILLed)", [
                      Comparison(f"cpu, {nnodes} nodes x 1 rank: kill -> next completed step", "s", *sides)], notes=[
        f"{rounds} alternating round(s); runs that did not finish: "
        + ", ".join(f"{key} {count}" for key, count in sorted(failed.items())) + ".",
        f"completed steps trained again: {steps}.",
        "checkpoint reads: gpuherd live 0 (node 1's spare takes node 0's state by broadcast); gpuherd restart 1.",
        f"built-in trainer, tiny model, checkpoint every 10 steps, kill at step {KILL_AT}; all nodes on one machine.",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
