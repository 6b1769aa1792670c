#!/usr/bin/env python3
"""Hang detection: a rank stops making progress; seconds until the launcher exits.

Side by side, interleaved: `python -m supervisor --script --hang-timeout T` vs
`torchrun` on the same 2-worker script (bench/hang_worker.py). torchrun has no
heartbeat, so it waits for the job (or NCCL's 10-minute watchdog); it is stopped
at the cap and reported as the cap (a lower bound). Writes bench/results/hang.md.

    python3 bench/bench_hang.py [--quick] [--hang-timeout 3] [--cap S]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import interleaved, write_results  # noqa: E402
from bench.launchers import TORCHRUN, exit_after  # noqa: E402

WORKER = ROOT / "bench" / "hang_worker.py"


def seconds_to_exit(kind: str, hang_timeout: float, cap: float, work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if kind == "gpuherd":
        cmd = [sys.executable, "-m", "supervisor", "--nproc", "2", "--hang-timeout", str(hang_timeout),
               "--run-id", out.name, "--set", f"system.run_root={work / 'logs'}", "--script", str(WORKER), str(out)]
    else:
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", str(WORKER), str(out)]
    proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    marker = out / "hung"
    while not marker.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{kind}: exited before the hang (code {proc.returncode})")
        time.sleep(0.02)
    time.sleep(0.05)  # the worker writes the marker right before it stops
    return exit_after(proc, float(marker.read_text()), cap)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions instead of 4")
    parser.add_argument("--hang-timeout", type=float, default=3.0)
    parser.add_argument("--cap", type=float, default=None, help="seconds before a launcher is stopped "
                        "(default 30; 10 with --quick: torchrun never exits on its own either way)")
    args = parser.parse_args()
    reps = 2 if args.quick else 4
    args.cap = args.cap or (10.0 if args.quick else 30.0)
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as tmp:
        work = Path(tmp)
        comparison = interleaved(
            f"rank 1 stops (2 workers) -> launcher exit; gpuherd --hang-timeout {args.hang_timeout:g}", "s",
            ("gpuherd", lambda: seconds_to_exit("gpuherd", args.hang_timeout, args.cap, work)),
            ("torchrun", lambda: seconds_to_exit("torchrun", args.hang_timeout, args.cap, work)),
            repeats=reps,
        )
    write_results("hang", "Hang detection", [comparison], notes=[
        f"{reps} interleaved repetitions; torchrun is stopped at {args.cap:g} s, so its figure is a lower bound "
        "(in a real NCCL job it waits for the 10-minute watchdog).",
        "gpuherd's time includes asking every worker for its Python stacks (SIGUSR1) before tearing down; exit code 124.",
    ])
    print(comparison.row())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
