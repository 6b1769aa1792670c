#!/usr/bin/env python3
"""A straggler moved out live, side by side with torchrun and ft_launcher; and no false straggler.

`side` (the default): 4 CPU ranks; SLOW_AT s after the first step rank 2 is slowed to a quarter
of its speed from outside (bench/slow_rank.py: a SIGSTOP/SIGCONT cycle on its process that holds
its CPU rate at a quarter of what it was over the MEASURE s before) and stays slowed. Steps per
second of rank 0 (the job's: every rank waits for the slowest), before (the SLOW_AT s up to the
slowdown, its first 5 s left out), during (from the slowdown to gpuherd's move-out, or WINDOW s
for the peers, which never move it) and after (WINDOW s from 5 s after the move-out; the peers:
the WINDOW s after that, still at the straggler's pace).

- gpuherd: the built-in trainer (bench_live_recovery.py's tiny model, widened so that compute is
  most of a step: `COMPUTE_BOUND`), `--max-restarts 1`, the
  default warm spare and the default move-out (2x for 30 s); the slowed process is the rank's,
  and the spare is a new process at full speed.
- torchrun, ft_launcher (`--ft-enable-nic-monitor false`): bench/straggler_worker.py, a DDP
  script of a CPU-bound step. A straggler makes no process fail, so neither launcher does
  anything.
- gpuherd-script: the same script under `gpuherd run --max-restarts 1` (its loop goes through
  gpuherd.live, a no-op under the other two): gpuherd moves its straggler out to the warm spare.

`noise`: 8 CPU ranks of the built-in trainer for MINUTES (10) with nothing slowed, on whatever
else the machine runs: the stragglers named and the ranks moved out (none expected).

Writes bench/results/straggler_move.md and .json (and prints it).

    python3 bench/bench_straggler_move.py [side|noise] [--minutes M] [--only LAUNCHER] [--quick]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_live_recovery import TINY  # noqa: E402
from bench.launchers import FT_LAUNCHER, Launchers, kill_tree, run_records, worker_env  # noqa: E402
from bench.slow_rank import SlowDown  # noqa: E402

SLOW_AT, WINDOW, FACTOR, RANKS, MEASURE = 20.0, 30.0, 4.0, 4, 3.0  # MEASURE: s of its own CPU rate, before
# a step whose compute is most of it, like straggler_worker.py's: the tiny model's steps are mostly
# Python and gloo, which a rank stopped 3/4 of the time slows far less than 4x on a shared host
COMPUTE_BOUND = ["model.dim=256", "model.n_layers=2", "data.context_length=64", "training.batch_size=8"]
WORKER = ROOT / "bench" / "straggler_worker.py"
RESULTS = ROOT / "bench" / "results" / "straggler_move.md"


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def _rate(steps: list[tuple[float, int]], t0: float, t1: float) -> float | None:
    inside = [(t, s) for t, s in steps if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in run_records(run_dir / "metrics.jsonl") if r.get("type") == kind]


def _gpuherd_cmd(work: Path, run_id: str, nproc: int, model: list[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--nproc", str(nproc),
           "--run-id", run_id, "--max-restarts", "1", "--set", f"system.run_root={work / 'logs'}"]
    for item in [*TINY, *model, "training.max_steps=1000000", "training.log_every=1", "training.save_every=0"]:
        cmd += ["--set", item]
    return cmd


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def gpuherd_side(work: Path) -> dict:
    run_dir = work / "logs" / "side"
    proc = subprocess.Popen(_gpuherd_cmd(work, "side", RANKS, COMPUTE_BOUND), cwd=work, env=worker_env(),
                            stdout=subprocess.DEVNULL, stderr=(work / "gpuherd.err").open("w"))

    def steps() -> list[tuple[float, int]]:
        return [(r["time"], r["step"]) for r in _records(run_dir, "step") if r.get("rank") == 0]

    slow = None
    try:
        assert _wait(lambda: steps(), 300), "gpuherd: no step"
        first = steps()[0][0]
        time.sleep(max(0.0, first + SLOW_AT - MEASURE - time.time()))
        pids = {r["rank"]: r["pid"] for r in _records(run_dir, "ready")}
        slowed = time.time() + MEASURE
        slow = SlowDown(pids[2], FACTOR, measure=MEASURE).start()
        moved = _wait(lambda: _records(run_dir, "recovery"), 120)
        moved_at = time.time() if moved else None
        end = (moved_at or slowed + WINDOW) + 5 + WINDOW
        time.sleep(max(0.0, end - time.time()))
    finally:
        if slow is not None:
            slow.stop()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
    s = steps()
    rec = (_records(run_dir, "recovery") or [{}])[-1]
    said = [line.strip() for line in (work / "gpuherd.err").read_text(errors="replace").splitlines()
            if "straggler" in line and "supervisor:" in line]
    return {"said": said, "name": "gpuherd (built-in trainer)", "before": _rate(s, first + 5, slowed),
            "during": _rate(s, slowed, moved_at or slowed + WINDOW),
            "after": _rate(s, (moved_at or slowed + WINDOW) + 5, end),
            "moved": f"rank 2 moved out {moved_at - slowed:.0f} s after the slowdown ({rec.get('kind')}, "
                     f"{rec.get('action')})" if moved_at else "not moved"}


def peer_side(work: Path, name: str) -> dict:
    """torchrun, ft_launcher or gpuherd-script (gpuherd running the same script: it moves the rank out)."""
    out = work / name
    launch = Launchers(work, WORKER)
    if name == "gpuherd-script":
        cmd = launch.gpuherd(RANKS, str(out), "1000000", flags=("--max-restarts", "1", "--run-id", "script"))
    else:
        cmd = (launch.torchrun if name == "torchrun" else launch.ft_launcher)(RANKS, str(out), "1000000")
    proc = subprocess.Popen(cmd, cwd=work, env=worker_env(), stdout=subprocess.DEVNULL,
                            stderr=(work / f"{name}.err").open("w"), start_new_session=True)
    log = out / "steps.log"

    def steps() -> list[tuple[float, int]]:
        if not log.exists():
            return []
        return [(float(t), int(s)) for t, s in (line.split() for line in log.read_text().splitlines() if line)]

    slow = None
    try:
        assert _wait(lambda: steps() and (out / "pid.2").exists(), 300), f"{name}: no step"
        first = steps()[0][0]
        time.sleep(max(0.0, first + SLOW_AT - MEASURE - time.time()))
        slowed = time.time() + MEASURE
        assert _wait(lambda: all((out / f"pid.{r}").exists() for r in range(RANKS)), 30)
        pids = {r: int((out / f"pid.{r}").read_text()) for r in range(RANKS)}
        slow = SlowDown(pids[2], FACTOR, measure=MEASURE).start()
        moved_at = None
        if name == "gpuherd-script" and _wait(lambda: _records(work / "logs" / "script", "recovery"), 120):
            moved_at = time.time()
        end = (moved_at or slowed + WINDOW) + 5 + WINDOW
        time.sleep(max(0.0, end - time.time()))
    finally:
        if slow is not None:
            slow.stop()
        kill_tree(proc)
    s = steps()
    rec = (_records(work / "logs" / "script", "recovery") or [{}])[-1] if moved_at else {}
    after = _rate(s, (moved_at or slowed + WINDOW) + 5, end)
    last = [line.strip() for line in (work / f"{name}.err").read_text(errors="replace").splitlines()][-3:]
    return {"name": f"{name} (bench/straggler_worker.py)", "before": _rate(s, first + 5, slowed),
            "during": _rate(s, slowed, moved_at or slowed + WINDOW), "after": after,
            "moved": f"rank 2 moved out {moved_at - slowed:.0f} s after the slowdown ({rec.get('kind')}, "
                     f"{rec.get('action')})" if moved_at else "not moved (nothing failed)",
            "said": [] if after else [f"{name}'s last words: {line}" for line in last]}


def side(work: Path, only: str | None = None) -> list[str]:
    load = _load()
    sides = {"gpuherd": lambda: gpuherd_side(work), "gpuherd-script": lambda: peer_side(work, "gpuherd-script"),
             "torchrun": lambda: peer_side(work, "torchrun"),
             "ft_launcher": lambda: peer_side(work, "ft_launcher") if Path(FT_LAUNCHER).exists() else
             {"name": "ft_launcher", "before": None, "during": None, "after": None,
              "moved": "not installed (pip install nvidia-resiliency-ext==0.4.1)"}}
    rows = [run() for name, run in sides.items() if only in (None, name)]
    lines = [f"## A straggler side by side ({RANKS} CPU ranks, rank 2 slowed to 1/{FACTOR:g} at {SLOW_AT:g} s)", "",
             f"Machine at the start: {load}; at the end: {_load()}.", "",
             "| launcher | steps/s before | during | after | after / before | what happened |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['after'] / r['before']:.2f}" if r["after"] and r["before"] else "-"
        lines.append(f"| {r['name']} | {_f(r['before'])} | {_f(r['during'])} | {_f(r['after'])} | {ratio} | "
                     f"{r['moved']} |")
    said = [line for r in rows for line in r.get("said", [])]
    return lines + ([""] + [f"- said: `{line[:300]}`" for line in said] if said else [])


def noise(work: Path, minutes: float) -> list[str]:
    load = _load()
    run_dir = work / "logs" / "noise"
    proc = subprocess.Popen(_gpuherd_cmd(work, "noise", 8), cwd=work, env=worker_env(),
                            stdout=subprocess.DEVNULL, stderr=(work / "noise.err").open("w"))
    try:
        assert _wait(lambda: _records(run_dir, "step"), 300), "no step"
        time.sleep(60 * minutes)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
    named = _records(run_dir, "straggler")
    moved = [r for r in _records(run_dir, "recovery") if r.get("kind") == "straggler"]
    steps = max((r["step"] for r in _records(run_dir, "step")), default=0)
    return [f"## No false straggler (8 CPU ranks, {minutes:g} min, nothing slowed)", "",
            f"Machine at the start: {load}; at the end: {_load()}.", "",
            f"{steps} steps; stragglers named: {len(named)}"
            + (" (" + ", ".join(f"rank {r['rank']} {r['slowdown']:.2f}x" for r in named) + ")" if named else "")
            + f"; ranks moved out: {len(moved)}."]


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="side", choices=("side", "noise"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--only", choices=("gpuherd", "gpuherd-script", "torchrun", "ft_launcher"),
                        help="side: one launcher")
    parser.add_argument("--quick", action="store_true", help="`python -m bench --quick`: side, 20 s windows")
    args = parser.parse_args()
    global WINDOW
    if args.quick:
        WINDOW = 20.0
    with tempfile.TemporaryDirectory() as tmp:
        lines = side(Path(tmp), args.only) if args.mode == "side" else noise(Path(tmp), args.minutes)
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    RESULTS.with_suffix(".json").write_bytes(orjson.dumps({"mode": args.mode, "lines": lines}))


if __name__ == "__main__":
    main()
