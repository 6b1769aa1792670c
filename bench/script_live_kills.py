#!/usr/bin/env python3
"""A user's own script recovered live, one kill or two in a row, timed from outside.

`gpuherd run --nproc 4 --max-restarts 2 examples/live_ddp.py --steps 60`; rank 1 SIGKILLed once
rank 0 printed step 20 and, with `--kills 2`, rank 2 `--gap` seconds after it. Per kill: seconds
from the SIGKILL to the arrival, on gpuherd's stdout, of rank 0's last line of the step that
recovery resumed at (the recovery's `resumed_step` in summary.json), beside the recovery's own
`seconds`. One JSON line per run.

    python3 bench/script_live_kills.py [--runs 3] [--kills 2] [--gap 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_script_live import KILL_AT, start_example  # noqa: E402
from bench.launchers import kill_tree  # noqa: E402

RANKS = 4


def one_run(work: Path, kills: int, gap: float) -> dict | None:
    proc, printed, reader = start_example(work, RANKS)
    killed: list[float] = []
    try:
        while not any(s >= KILL_AT for _, s in printed):
            if proc.poll() is not None:
                return None
            time.sleep(0.005)
        for rank in range(1, kills + 1):
            if killed:
                time.sleep(max(0.0, killed[0] + gap * (rank - 1) - time.time()))
            victim = next(c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == str(rank))
            killed.append(time.time())
            victim.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        kill_tree(proc)
        reader.join(timeout=10)
    [summary_path] = (work / "logs").glob("*/summary.json")
    summary = orjson.loads(summary_path.read_bytes())
    out: dict = {"exit": code, "restarts": summary["restarts"], "load": round(os.getloadavg()[0], 1), "kills": []}
    for rec, at in zip(summary["recoveries"], killed):
        lines = [t for t, step in printed if t > at and step == rec.get("resumed_step")]
        out["kills"].append({"outcome": rec["outcome"], "outside_s": round(max(lines) - at, 3) if lines else None,
                             "supervisor_s": rec.get("seconds")})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kills", type=int, choices=(1, 2), default=1)
    parser.add_argument("--gap", type=float, default=5.0, help="seconds between the two kills")
    args = parser.parse_args()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as work:
            print(orjson.dumps(one_run(Path(work), args.kills, args.gap)).decode(), flush=True)


if __name__ == "__main__":
    main()
