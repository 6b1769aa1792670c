#!/usr/bin/env python3
"""After a hang verdict, how long to the next completed step, against a kill's restart.

The built-in trainer (tiny model, CPU, 2 ranks) with restarts (`--spares 0 --max-restarts 2`)
and with live recovery (defaults); rank 1 is either SIGKILLed or SIGSTOPped once 10 steps
completed. Measured: a kill -> the next completed step of any rank; a stop -> its hang verdict
(supervisor.log) -> the next completed step. The verdict itself comes `--hang-timeout` after
the stop; what follows it is what this measures.

    python bench/hang_cost.py [--hang-timeout 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import datetime
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launchers import run_records as _records, worker_env  # noqa: E402

TINY = ["data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
        "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
        "training.grad_accum_nums=1", "training.max_steps=100000", "training.warmup_steps=5", "training.log_every=1",
        "training.eval_every=0", "training.save_every=0"]




def _verdict_at(log: Path) -> float | None:
    for line in log.read_text(errors="replace").splitlines():
        if " ERROR | hang: rank 1" in line:
            return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return None


def one(work: Path, how: int, live: bool, hang_timeout: float) -> float | None:
    """Seconds from the kill (or the hang verdict) to the next completed step."""
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--run-id", "r", "--nproc", "2",
           "--hang-timeout", str(hang_timeout), "--max-restarts", "2", "--set", "system.device=cpu",
           "--set", f"system.run_root={work / 'logs'}", "--set", f"data.cache_dir={work / 'cache'}"]
    cmd += [] if live else ["--spares", "0"]
    for item in TINY:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = work / "logs" / "r"
    metrics = run_dir / "metrics.jsonl"
    try:
        while not any(r.get("type") == "step" and r.get("step", 0) >= 10 for r in _records(metrics)):
            time.sleep(0.02)
        victim = [r["pid"] for r in _records(metrics) if r.get("type") == "ready" and r.get("rank") == 1][0]
        psutil.Process(victim).send_signal(how)
        hit = time.time()
        deadline = hit + 120
        while time.time() < deadline:
            start = hit if how == signal.SIGKILL else _verdict_at(run_dir / "supervisor.log")
            later = [r["time"] for r in _records(metrics) if r.get("type") == "step" and r["time"] > hit + 0.01
                     and start is not None and r["time"] > start]
            if start is not None and later:
                return min(later) - start
            time.sleep(0.05)
        return None
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hang-timeout", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    for live in (False, True):
        for how in (signal.SIGKILL, signal.SIGSTOP):
            got = []
            for _ in range(args.rounds):
                with tempfile.TemporaryDirectory(prefix="gpuherd-hang-cost-") as tmp:
                    got.append(one(Path(tmp), how, live, args.hang_timeout))
            what = "kill -> next step" if how == signal.SIGKILL else "hang verdict -> next step"
            print(f"{'live recovery' if live else 'restarts (--spares 0)'}, {how.name}: {what}: "
                  + ", ".join("never" if s is None else f"{s:.2f} s" for s in got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
