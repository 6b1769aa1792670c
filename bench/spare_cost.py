#!/usr/bin/env python3
"""What warm spares cost the ranks they stand beside: the built-in trainer with --spares K.

The built-in trainer (the goodput benchmark's settings: debug-sized Llama, CPU, 2 ranks,
--max-restarts 8) runs `--seconds` with `--spares K` and no fault. Every `--every` seconds
each process under the supervisor is read from /proc (utime + stime): the ranks' (RANK in their
environment) and the spares' (GPUHERD_SPARE=1: spawned spares, the spare source and its forks,
which carry the source's environment). One JSON line per run: rank 0's steps in the first
`--window` seconds after its first step, and over the last interval the waiting processes' CPU
seconds against the ranks', and the CPU seconds the spares used in all (their warm-ups).

    python bench/spare_cost.py [--spares 1 4] [--root CHECKOUT] [--seconds 75]

`--root`: the checkout whose gpuherd runs (default: this one), for a before/after in the same
machine state.
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

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_goodput import BUILTIN  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def _roles(supervisor: int) -> dict[int, str]:
    """Each child of the supervisor: `rank` (RANK in its environment), or `spare` (waiting)."""
    roles = {}
    for child in psutil.Process(supervisor).children():
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if env.get("GPUHERD_SPARE") == "1":
            roles[child.pid] = "spare"
        elif "RANK" in env:
            roles[child.pid] = "rank"
    return roles


def one_run(root: Path, spares: int, seconds: float, every: float, window: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix="spare-cost-"))
    cmd = [sys.executable, "-m", "supervisor", "--no-report", "--max-restarts", "8", "--spares", str(spares),
           "--nproc", "2", "--set", "system.device=cpu", "--set", f"system.run_root={work / 'logs'}",
           "--set", f"system.checkpoint_dir={work / 'ckpt'}", "--set", "training.max_steps=1000000",
           "--set", "training.save_every=1000000"]
    for item in BUILTIN:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    samples: list[tuple[float, dict[int, str], dict[int, float]]] = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(every)
            roles = _roles(proc.pid)
            samples.append((time.monotonic(), roles, {pid: c for pid in roles if (c := _cpu_s(pid)) is not None}))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    [metrics] = (work / "logs").glob("*/metrics.jsonl")
    steps = [r["time"] for line in metrics.read_bytes().splitlines()
             if (r := orjson.loads(line)).get("type") == "step" and r.get("rank") == 0]
    last = {"rank": 0.0, "spare": 0.0}
    if len(samples) >= 2:
        (_, _, before), (_, roles, after) = samples[-2], samples[-1]
        for pid, role in roles.items():
            if pid in before and pid in after:
                last[role] += after[pid] - before[pid]
    return {"root": str(root), "spares": spares, "load": round(os.getloadavg()[0], 1),
            "steps_in_window": sum(1 for t in steps if steps and t - steps[0] <= window),
            "waiting": sum(1 for role in samples[-1][1].values() if role == "spare") if samples else 0,
            "last_window_cpu_s": {k: round(v, 2) for k, v in last.items()},
            "spares_cpu_total_s": round(sum(c for pid, c in samples[-1][2].items() if samples[-1][1][pid] == "spare"), 2)
            if samples else None,
            "spares_vs_ranks": round(last["spare"] / last["rank"], 4) if last["rank"] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spares", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--every", type=float, default=15.0)
    parser.add_argument("--window", type=float, default=45.0)
    args = parser.parse_args()
    for k in args.spares:
        print(orjson.dumps(one_run(args.root.resolve(), k, args.seconds, args.every, args.window)).decode(), flush=True)


if __name__ == "__main__":
    main()
