#!/usr/bin/env python3
"""Orphans: SIGKILL the launcher, count its workers and their children still alive 1 s later.

Side by side, interleaved: `python -m supervisor --script` vs `torchrun` on the
same worker script (bench/orphan_worker.py: each worker forks one child). Writes
bench/results/orphans.md and .json.

    python3 bench/bench_orphans.py [--quick] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import interleaved, write_results  # noqa: E402

WORKER = ROOT / "bench" / "orphan_worker.py"


def _launch(kind: str, workers: int, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if kind == "gpuherd":
        cmd = [sys.executable, "-m", "supervisor", "--nproc", str(workers), "--run-id", out.name,
               "--set", f"system.run_root={out.parent / 'logs'}", "--script", str(WORKER), str(out)]
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
        cmd = [torchrun, "--standalone", f"--nproc-per-node={workers}", str(WORKER), str(out)]
    return subprocess.Popen(cmd, env=env, cwd=out.parent, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def survivors(kind: str, workers: int, work: Path) -> float:
    out = Path(tempfile.mkdtemp(dir=work))
    launcher = _launch(kind, workers, out)
    deadline = time.monotonic() + 60
    while len(list(out.iterdir())) < 2 * workers:  # every worker and its child are up
        if time.monotonic() > deadline or launcher.poll() is not None:
            raise RuntimeError(f"{kind}: workers did not start")
        time.sleep(0.05)
    pids = [int(p.name.split("-")[1]) for p in out.iterdir()]
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    time.sleep(1.0)
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    for pid in alive:  # clean up what the launcher left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return float(len(alive))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions instead of 6")
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    reps = 3 if args.quick else 6
    with tempfile.TemporaryDirectory(prefix="bench-orphans-") as tmp:
        work = Path(tmp)
        comparison = interleaved(
            f"processes alive 1 s after SIGKILL of the launcher ({args.workers} workers + 1 child each)", "procs",
            ("gpuherd", lambda: survivors("gpuherd", args.workers, work)),
            ("torchrun", lambda: survivors("torchrun", args.workers, work)),
            repeats=reps,
        )
    write_results("orphans", "Orphans after the launcher is SIGKILLed", [comparison], notes=[
        f"{reps} interleaved repetitions; fewer is better. The 'advantage' column is a ratio of "
        "medians and is infinite when gpuherd leaves none.",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
