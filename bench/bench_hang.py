#!/usr/bin/env python3
"""Hang detection with default settings: rank 1 of 2 stops (SIGSTOP) at step 40; seconds
from the stop until the launcher exits, and whom gpuherd's verdict named.

The same gloo worker (bench/blame_worker.py, ~20 ms steps) under each launcher, round
robin. gpuherd: no hang flag, so the learned allowance applies (max(10 s, 5 x p99 of
the step times)). NVIDIA's ft_launcher 0.4.1: its defaults (45 min heartbeat timeout)
plus the timeouts it learns in-run (the worker calls calculate_and_set_hb_timeouts at
step 30: 5 x the longest heartbeat interval; checked every 5 s). torchrun has no
heartbeat: it is stopped at the cap and reported as the cap (a lower bound). gpuherd runs
with its default settings (no report on the exit path, like the others); what `--report`
(report.html rendered before the exit) adds is a row of its own. Writes bench/results/hang.md.

    python3 bench/bench_hang.py [--quick] [--cap S]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.compare import Comparison, Side, write_results  # noqa: E402
from bench.launchers import Launchers, exit_after, worker_env  # noqa: E402

WORKER = ROOT / "bench" / "blame_worker.py"
KINDS = ("gpuherd", "ft_launcher", "torchrun", "gpuherd hang_floor=2", "gpuherd with report")
FLOOR_2 = ("--set", "system.hang_floor=2")  # the learned allowance's floor lowered from 10 s to 2 s


def command(ln: Launchers, kind: str, out: Path) -> list[str]:
    if kind.startswith("gpuherd"):
        flags = ("--run-id", out.name, *(FLOOR_2 if "floor" in kind else ()))
        return ln.gpuherd(2, str(out), "hang", flags=flags, report="report" in kind)
    launch = ln.ft_launcher if kind == "ft_launcher" else ln.torchrun
    return launch(2, str(out), "hang", flags=("--standalone",))


def detect(ln: Launchers, kind: str, cap: float, named: list[int | None], verdicts: dict[str, list[float]]) -> float:
    out = Path(tempfile.mkdtemp(dir=ln.work))
    proc = subprocess.Popen(command(ln, kind, out), env=worker_env(), cwd=ln.work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    marker = out / "hung"
    while not marker.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"{kind}: exited before the hang (code {proc.returncode})")
        time.sleep(0.02)
    time.sleep(0.05)  # the worker writes the marker right before it stops
    seconds = exit_after(proc, float(marker.read_text()), cap)
    if kind.startswith("gpuherd"):
        summary = orjson.loads((ln.work / "logs" / out.name / "summary.json").read_bytes())
        named.append((summary.get("root_cause") or {}).get("rank"))
        if kind in verdicts:
            verdicts[kind].append(seconds - (summary.get("teardown_s") or 0.0))
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds instead of 6")
    parser.add_argument("--cap", type=float, default=None,
                        help="seconds before a launcher is stopped (default 90; 30 with --quick)")
    args = parser.parse_args()
    rounds = 3 if args.quick else 6
    args.cap = args.cap or (30.0 if args.quick else 90.0)
    samples: dict[str, list[float]] = {k: [] for k in KINDS}
    named: list[int | None] = []
    # the stop -> the verdict: the exit minus the teardown, so only runs that end right after it
    verdicts: dict[str, list[float]] = {k: [] for k in KINDS if k.startswith("gpuherd") and "report" not in k}
    with tempfile.TemporaryDirectory(prefix="bench-hang-") as tmp:
        ln = Launchers(Path(tmp), WORKER, grace_period=2)
        for i in range(rounds):
            for kind in KINDS[i % len(KINDS):] + KINDS[:i % len(KINDS)]:  # each launcher goes first in turn
                samples[kind].append(detect(ln, kind, args.cap, named, verdicts))
    gpuherd = Side("gpuherd", samples["gpuherd"])
    comparisons = [Comparison(f"rank 1 stops -> launcher exit, default settings: vs {kind}", "s", gpuherd,
                              Side(kind, samples[kind])) for kind in ("ft_launcher", "torchrun")]
    comparisons.append(Comparison("rank 1 stops -> launcher exit, gpuherd with --set system.hang_floor=2: "
                                  "vs ft_launcher", "s", Side("gpuherd hang_floor=2", samples["gpuherd hang_floor=2"]),
                                  Side("ft_launcher", samples["ft_launcher"])))
    comparisons.append(Comparison("rank 1 stops -> launcher exit, gpuherd --report (rendered before the exit) vs the default",
                                  "s", Side("gpuherd with report", samples["gpuherd with report"]), gpuherd))
    right = sum(rank == 1 for rank in named)
    write_results("hang", "Hang detection (default settings)", comparisons, notes=[
        f"{rounds} round-robin rounds; torchrun never notices (no heartbeat): stopped at the {args.cap:g} s cap, "
        "so its figure is a lower bound (a real NCCL job waits for the 10-minute watchdog).",
        "ft_launcher: its defaults (initial 60 min / heartbeat 45 min) plus the timeouts the worker has it learn "
        "in-run at step 30 (RankMonitorClient.calculate_and_set_hb_timeouts: 5 x the longest interval seen).",
        "gpuherd: no --hang-timeout, so the learned step allowance (max(10 s floor, 5 x p99)); its time includes "
        "asking the live rank for its collective trace and every rank for its stacks before the teardown; "
        "default settings (the report is not on the exit path), except in the report row, whose ratio below 1 is "
        "what `--report` (matplotlib figures and report.html, rendered after every worker is gone) adds to the exit.",
        f"gpuherd's verdict named the stopped rank 1 in {right} of {len(named)} runs "
        f"(named: {', '.join(str(r) for r in named)}); the verdict came " + "; ".join(
            f"{statistics.median(v):.1f} s ({kind}, median; {min(v):.1f}-{max(v):.1f})" for kind, v in verdicts.items())
        + " after the stop, the rest of the exit time is the collective traces, the stacks and the teardown.",
        "ft_launcher's learned timeout is 5 x the longest heartbeat interval seen (here well under a second): "
        "quick, and also what a garbage-collection pause or a slow checkpoint trips; gpuherd's 10 s floor is "
        "the margin against that, `system.hang_floor` lowers it.",
    ])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
