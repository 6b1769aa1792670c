#!/usr/bin/env python3
"""Is anything a launcher started still there when its exit code arrives?

Each round starts the built-in trainer (debug preset, CPU, 2 workers, max_steps raised so it
is mid-run, a fresh run directory and, unless --reuse-cache, a fresh dataset cache, so the
build's tokenizer pool runs too), SIGKILLs rank 1 once a step completed, and watches the
launcher's process tree (every 10 ms) until its exit code arrives; then every process seen
in the tree that still exists (running, or exited but not reaped) is a leftover.

    python bench/teardown_leftovers.py [--rounds 20] [--reuse-cache]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launchers import run_records, worker_env  # noqa: E402


def watch(proc: subprocess.Popen, until: float) -> list[str]:
    """The launcher's descendants still present the moment its exit code arrived (one line
    each), having polled its tree until then; a launcher still running at `until` is killed
    with its tree and reported as one leftover line."""
    seen: dict[int, tuple[float, str]] = {}
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None:
        if time.monotonic() > until:
            for child in launcher.children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
            return [f"the launcher did not exit in time (pid {proc.pid})"]
        try:
            children = launcher.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                seen.setdefault(child.pid, (child.create_time(), " ".join(child.cmdline())[:100]))
            except psutil.Error:
                continue
        time.sleep(0.01)
    left = []
    for pid, (created, cmd) in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created:
                left.append(f"pid {pid} ({p.status()}): {cmd}")
        except psutil.Error:
            continue
    return left


def _records(path: Path, kind: str) -> list[dict]:
    return [r for r in run_records(path) if r.get("type") == kind]


def one_round(work: Path, extra: list[str], cache: Path, cap: float = 240.0) -> list[str]:
    """Leftovers of one run whose rank 1 is SIGKILLed after its first completed step."""
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--run-id", "r", "--nproc", "2",
           "--set", "system.device=cpu", "--set", f"system.run_root={work / 'logs'}",
           "--set", f"data.cache_dir={cache}", "--set", "training.max_steps=100000", *extra]
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = work / "logs" / "r" / "metrics.jsonl"
    deadline = time.monotonic() + cap
    while not _records(metrics, "step") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    ready = [r["pid"] for r in _records(metrics, "ready") if r.get("rank") == 1]
    if ready:
        try:
            psutil.Process(ready[0]).send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    return watch(proc, deadline)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reuse-cache", action="store_true", help="build the dataset cache once, not every round")
    ap.add_argument("--set", action="append", default=[], help="more --set KEY=VALUE for every run")
    args = ap.parse_args()
    extra = [item for kv in args.set for item in ("--set", kv)]
    dirty = 0
    with tempfile.TemporaryDirectory(prefix="gpuherd-leftovers-") as tmp:
        for n in range(args.rounds):
            work = Path(tmp) / f"round{n}"
            work.mkdir()
            cache = Path(tmp) / "cache" if args.reuse_cache else work / "cache"
            left = one_round(work, extra, cache)
            dirty += bool(left)
            print(f"round {n + 1}: " + ("nothing left" if not left else f"{len(left)} left: " + "; ".join(left)),
                  flush=True)
    print(f"{dirty} of {args.rounds} teardowns left a process the launcher started behind its exit code")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
