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
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_live_recovery import KILL_AT, TINY, _records  # noqa: E402
from bench.bench_multinode import _port  # noqa: E402
from bench.compare import Comparison, Side, write_results  # noqa: E402
from bench.launchers import kill_tree, worker_env  # noqa: E402


def _commands(work: Path, nnodes: int, live: bool) -> list[list[str]]:
    port = _port()
    out = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "supervisor", "--no-report", "--run-id", "r", "--max-restarts", "1",
               "--set", "system.device=cpu", "--nproc", "1", "--nnodes", str(nnodes), "--node-rank", str(node),
               "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--set", f"system.run_root={work / 'logs'}", "--set", f"system.checkpoint_dir={work / 'ckpt'}"]
        cmd += [] if live else ["--spares", "0"]
        for item in TINY:
            cmd += ["--set", item]
        out.append(cmd)
    return out


def trained(work: Path, nnodes: int, live: bool, cap: float = 400) -> tuple[float, int] | None:
    """(seconds from the kill to rank 1's next completed step, completed steps trained again), or None."""
    metrics = work / "logs" / "r-node1" / "metrics.jsonl"
    procs = [subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True) for cmd in _commands(work, nnodes, live)]
    try:
        deadline = time.monotonic() + cap
        while not any(r.get("type") == "step" and r.get("step", -1) >= KILL_AT for r in _records(metrics)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return None
            time.sleep(0.01)
        victim = [r["pid"] for r in _records(metrics) if r.get("type") == "ready" and r["rank"] == 1][-1]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        if any(p.wait(timeout=cap) != 0 for p in procs):
            return None
        steps = [r for r in _records(metrics) if r.get("type") == "step"]
        before = max(r["step"] + 1 for r in steps if r["time"] < killed)
        first = min((r for r in steps if r["time"] > killed), key=lambda r: r["time"])  # rank 1's replacement's
        return first["time"] - killed, max(0, before - first["step"])
    except subprocess.TimeoutExpired:
        return None
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)


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
