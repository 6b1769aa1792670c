#!/usr/bin/env python3
"""What a refilling spare pool costs the training it runs beside, and what a recovery costs.

The built-in trainer (debug preset, CPU, 2 ranks, byte tokenizer, dummy data, defaults:
--max-restarts 8 and one warm spare) is killed at rank 1 KILLS times in a row (SIGKILL, each
once the previous recovery completed and a few steps more ran). From rank 0's step records
(metrics.jsonl): the median step interval in a quiet window before the first kill, and in
the window after each recovery while the new spare warms up (the refill); and per recovery
the seconds from the kill to the next completed step and the rebuilt group's first step
(the newcomer's state taken -> its first completed step) against the median.

    python bench/refill_cost.py [--kills 4] [--window 8]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launchers import run_records as _records, worker_env  # noqa: E402




def _steps(records: list[dict], rank: int = 0) -> list[tuple[float, int]]:
    return [(r["time"], r["step"]) for r in records if r.get("type") == "step" and r.get("rank") == rank]


def _intervals(steps: list[tuple[float, int]], start: float, end: float) -> list[float]:
    return [b[0] - a[0] for a, b in zip(steps, steps[1:]) if start <= a[0] and b[0] <= end and b[1] == a[1] + 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=4)
    ap.add_argument("--window", type=float, default=8.0, help="seconds of steps measured before/after")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuherd-refill-") as tmp:
        work = Path(tmp)
        cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--run-id", "r", "--nproc", "2",
               "--max-restarts", "8", "--set", "system.device=cpu", "--set", f"system.run_root={work / 'logs'}",
               "--set", f"data.cache_dir={work / 'cache'}", "--set", "data.dataset=dummy",
               "--set", "data.tokenizer=byte", "--set", "training.max_steps=100000", "--set", "training.eval_every=0"]
        proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = work / "logs" / "r" / "metrics.jsonl"
        kills: list[float] = []
        try:
            while len(_steps(_records(metrics))) < 30:
                time.sleep(0.05)
            time.sleep(args.window)
            victim = [r["pid"] for r in _records(metrics) if r.get("type") == "ready" and r.get("rank") == 1][0]
            for n in range(args.kills):
                kills.append(time.time())
                psutil.Process(victim).send_signal(signal.SIGKILL)
                while len([r for r in _records(metrics) if r.get("type") == "recovery"]) <= n:
                    if proc.poll() is not None:
                        raise SystemExit("the run ended")
                    time.sleep(0.05)
                victim = [r for r in _records(metrics) if r.get("type") == "recovery"][-1]["replaced_by_pid"]
                time.sleep(args.window)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        records = _records(metrics)
    steps = _steps(records)
    quiet = _intervals(steps, kills[0] - args.window, kills[0])
    median = statistics.median(quiet)
    print(f"before the first kill: median step {median * 1000:.0f} ms over {len(quiet)} steps")
    recoveries = [r for r in records if r.get("type") == "recovery"]
    for n, (killed, rec) in enumerate(zip(kills, recoveries)):
        done = killed + (rec.get("seconds") or 0)
        after = [t for t, _ in steps if t > done]
        generation = n + 1  # the newcomer's rebuilt group: from its state taken to its first completed step
        live = [r for r in records if r.get("type") == "live" and r.get("generation") == generation and r.get("rank") == 1]
        joined = next((r["time"] for r in live if r.get("event") == "rejoined"), None)
        stepped = next((r["time"] for r in live if r.get("event") == "first_step"), None)
        first = stepped - joined if joined is not None and stepped is not None else None
        refill = _intervals(steps, (after[0] if after else done), done + args.window)
        print(f"kill {n + 1}: {rec['outcome']}, {rec.get('seconds')} s to the next completed step; the rebuilt group's "
              f"first step {(first or 0) * 1000:.0f} ms ({(first or 0) / median:.2f}x median); while the new spare warms up: "
              f"median step {statistics.median(refill) * 1000 if refill else float('nan'):.0f} ms "
              f"({(statistics.median(refill) / median) if refill else float('nan'):.2f}x) over {len(refill)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
