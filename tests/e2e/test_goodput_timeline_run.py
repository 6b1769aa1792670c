"""Goodput's accounting against a timeline the test makes itself.

One run of the built-in trainer (2 CPU ranks, a tiny model, a checkpoint every 10 steps)
under a one-node SLURM environment goes through, in order: a live recovery (rank 1
SIGKILLed, the warm spare takes it), a hang (the new rank 1 SIGSTOPped: the verdict, then
the refilled spare takes it), a restart (both ranks SIGKILLed: no survivor holds the state,
the next attempt resumes from the newest checkpoint) and a preemption (SIGTERM: save and
stop), and SLURM's requeue then continues the run as its second start. The test notes when
it injected each fault and reads from the step records when training went on; summary.json's
goodput block is checked cause by cause against those intervals, each bound with the slack
it states. docs/guide/goodput.md defines the causes."""

from __future__ import annotations

import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import orjson
import psutil
import pytest

from supervisor.goodput import CAUSES
from tests.e2e.helpers import records
from tests.e2e.test_live_recovery_run import TINY
from tests.supervisor.helpers import finish, wait_for
from tests.supervisor.test_resubmission import slurm_env

STEPS = 80
# the live recovery tests' tiny model (a later --set wins), with a checkpoint every 10 steps
SETTINGS = [*TINY, f"training.max_steps={STEPS}", "training.save_every=10", "training.keep_last=2"]
DETECT_EXIT_S = 1.5  # a SIGKILLed rank's exit is seen on SIGCHLD: milliseconds, with room for a loaded machine
HANG_NAMED_S = 5.0  # a stopped rank is a hang within 5 s at default settings (3 s of state T, then the next check)
REPLACE_S = 0.5  # the hung rank SIGKILLed at its verdict and reaped before the spare takes it


def _command() -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--slurm", "--run-id", "g", "--no-report", "--nproc", "2",
           "--max-restarts", "6", "--set", "system.device=cpu"]
    for item in SETTINGS:
        cmd += ["--set", item]
    return cmd


@dataclass
class Timeline:
    """What the test did, when (time.time(), as every record carries it)."""

    launched: list[float] = field(default_factory=list)  # each start's Popen
    exited: list[float] = field(default_factory=list)  # each start's exit seen
    kill: float = 0.0  # rank 1 SIGKILLed: a live recovery
    stop: float = 0.0  # rank 1 SIGSTOPped: a hang, then a live recovery
    both: float = 0.0  # both ranks SIGKILLed: a restart
    term: float = 0.0  # SIGTERM to the supervisor: a preemption, then the requeue


def _steps(run_dir, rank: int) -> list[tuple[float, int]]:
    return sorted((r["time"], r["step"]) for r in records(run_dir, "step") if r["rank"] == rank)


def _recovered(run_dir, number: int) -> dict | None:
    return next((r for r in records(run_dir, "recovery") if r.get("number") == number
                 and r.get("outcome") == "recovered"), None)


def _reached(run_dir, step: int) -> bool:
    return any(s >= step for _, s in _steps(run_dir, 0))


def _outside(a: float, b: float, windows: list[tuple[float, float]]) -> float:
    """The seconds of [a, b] outside every window (the windows do not overlap)."""
    return (b - a) - sum(max(0.0, min(b, end) - max(a, start)) for start, end in windows)


def _first_after(steps: list[tuple[float, int]], t: float) -> float:
    return min(at for at, _ in steps if at > t)


def _last_before(steps: list[tuple[float, int]], t: float) -> float:
    return max(at for at, _ in steps if at <= t)


def _start_one(tmp_path, run_dir, line: Timeline) -> subprocess.Popen:
    """Start 1 through a live recovery, a hang, a restart, and a preemption's SIGTERM."""
    line.launched.append(time.time())
    proc = subprocess.Popen(_command(), cwd=tmp_path, env=slurm_env("700"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert wait_for(lambda: _reached(run_dir, 6), timeout=240, interval=0.05)
    ready: dict[int, int] = {}
    for r in records(run_dir, "ready"):  # each rank's first process (a promoted spare says so again)
        ready.setdefault(r["rank"], r["pid"])
    line.kill = time.time()
    psutil.Process(ready[1]).send_signal(signal.SIGKILL)
    assert wait_for(lambda: _recovered(run_dir, 1) is not None, timeout=120, interval=0.05)
    first = _recovered(run_dir, 1)
    assert wait_for(lambda: _reached(run_dir, first["resumed_step"] + 4), timeout=120, interval=0.05)

    line.stop = time.time()
    psutil.Process(first["replaced_by_pid"]).send_signal(signal.SIGSTOP)
    assert wait_for(lambda: _recovered(run_dir, 2) is not None, timeout=120, interval=0.05)
    second = _recovered(run_dir, 2)
    # a checkpoint after the hang, then a few steps: the restart redoes exactly those
    assert wait_for(lambda: any(r["step"] > second["resumed_step"] for r in records(run_dir, "checkpoint")),
                    timeout=120, interval=0.05)
    saved = max(r["step"] for r in records(run_dir, "checkpoint"))
    assert wait_for(lambda: _reached(run_dir, saved + 3), timeout=120, interval=0.05)

    line.both = time.time()
    for pid in (ready[0], second["replaced_by_pid"]):
        psutil.Process(pid).send_signal(signal.SIGKILL)
    assert wait_for(lambda: any(at > line.both for at, _ in _steps(run_dir, 0)), timeout=120, interval=0.05)
    resumed = min(s for at, s in _steps(run_dir, 0) if at > line.both)
    assert wait_for(lambda: _reached(run_dir, resumed + 4), timeout=120, interval=0.05)
    line.term = time.time()
    proc.send_signal(signal.SIGTERM)
    return proc


def _clean_intervals(steps: list[tuple[float, int]], cuts: list[float], faults: list[tuple[float, float]]
                     ) -> list[tuple[float, float]]:
    """Rank 0's step-to-step intervals that are training and nothing else: within one attempt
    (no start or attempt mark in them) and clear of every fault's window."""
    return [(a, b) for (a, _), (b, _) in zip(steps, steps[1:])
            if not any(a < c <= b for c in cuts) and not any(a < hi and b > lo for lo, hi in faults)]


@pytest.mark.slow  # two starts and four faults: ~35 s on a quiet 2-core machine, 2 min at load 15
def test_each_goodput_cause_matches_the_timeline_of_a_faulted_run_continued_by_a_requeue(tmp_path):
    run_dir = tmp_path / "logs" / "g"
    line = Timeline()
    proc = _start_one(tmp_path, run_dir, line)
    try:
        code, _, err = finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    line.exited.append(time.time())
    assert code == 128 + signal.SIGTERM, err[-3000:]
    first = orjson.loads((run_dir / "summary.json").read_bytes())
    assert first["final_save"] == "saved" and len(first["attempts"]) == 2, err[-3000:]

    line.launched.append(time.time())
    second = subprocess.run(_command(), cwd=tmp_path, env={**slurm_env("700"), "SLURM_RESTART_COUNT": "1"},
                            capture_output=True, text=True, timeout=240)
    line.exited.append(time.time())
    assert second.returncode == 0, second.stderr[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["start"] == 1 and summary["attempts"][0]["resumed_from"]

    g, was = summary["goodput"], first["goodput"]
    bad = g["badput_s"]
    assert set(bad) == set(CAUSES)
    assert g["productive_s"] + sum(bad.values()) == pytest.approx(g["wall_s"], abs=0.002)  # parts add up
    ran = sum(b - a for a, b in zip(line.launched, line.exited))
    assert ran - 4.0 <= g["wall_s"] <= ran + 0.05  # each start's own time (its exit after the summary not in it)

    # the second start's account holds the first's, and only its own time more
    at_first_end = records(run_dir, "goodput")[0]  # metrics.jsonl's record at the end of start 1
    assert {key: at_first_end[key] for key in was} == was
    own = line.exited[1] - line.launched[1]
    assert was["wall_s"] - 4.0 <= g["wall_s"] - own <= was["wall_s"] + 0.05
    for cause in CAUSES:
        if cause != "other":  # the first start's tail ends at its last record once a second start follows
            assert was["badput_s"][cause] - 0.002 <= bad[cause] <= was["badput_s"][cause] + own, cause
    assert was["productive_s"] <= g["productive_s"] <= was["productive_s"] + own

    steps0, steps1 = _steps(run_dir, 0), _steps(run_dir, 1)
    recoveries = [r for r in first["recoveries"] if r["outcome"] == "recovered"]  # start 1 had them
    assert [r["kind"] for r in recoveries] == ["worker-exit", "hang"], first["recoveries"]
    assert "stopped by a signal (state T)" in recoveries[1]["failed"]
    by_number = {r["number"]: r for r in records(run_dir, "recovery") if r.get("outcome") == "recovered"}
    lost = [by_number[n]["time"] - by_number[n]["seconds"] for n in (1, 2)]
    failed_at = next(r["failed_at"] for r in records(run_dir, "timeline")
                     if r["event"] == "attempt_end" and r["attempt"] == 0 and r["failed_at"] is not None)
    # the supervisor knew of each fault when the fault said it would
    assert 0.0 <= lost[0] - line.kill <= DETECT_EXIT_S
    assert 3.0 <= lost[1] - line.stop <= HANG_NAMED_S + REPLACE_S
    assert 0.0 <= failed_at - line.both <= DETECT_EXIT_S

    # when training went on after each fault: the newcomer's first step (live recovery), rank 0's
    # first step of the restarted attempt and of the second start
    went_on = [_first_after(steps1, lost[0]), _first_after(steps1, lost[1]), _first_after(steps0, failed_at),
               _first_after(steps0, line.launched[1])]
    faults = [line.kill, line.stop, line.both, line.launched[1]]
    windows = list(zip(faults, went_on, strict=True))
    cuts = [r["time"] for r in records(run_dir, "timeline") if r["event"] in ("start", "attempt")]
    clean = _clean_intervals(steps0, cuts, [*windows, (line.term, line.term)])
    step_s = statistics.median(b - a for a, b in clean)
    assert step_s < 1.0, "steps too slow for the slack below"
    slack = 0.5 + 4 * step_s

    # failure detection: the kills' exits and the hang's verdict, from the last step before each
    before = [_last_before(steps0, t) for t in (line.kill, line.stop, line.both)]
    fd = bad["failure_detection"]
    assert fd >= 3.0 - 2 * step_s  # the hang alone: 3 s in state T before its verdict
    assert fd <= (line.kill + DETECT_EXIT_S - before[0]) + (line.stop + HANG_NAMED_S + REPLACE_S - before[1]) \
        + (line.both + DETECT_EXIT_S - before[2])

    # restart (and the checkpoint read within it): each fault's detection to training going on,
    # the second start from its launch
    lo = (went_on[0] - line.kill - DETECT_EXIT_S) + (went_on[1] - line.stop - HANG_NAMED_S - REPLACE_S) \
        + (went_on[2] - line.both - DETECT_EXIT_S) + (went_on[3] - line.launched[1] - 1.0)
    hi = (went_on[0] - line.kill) + (went_on[1] - line.stop - 3.0) + (went_on[2] - line.both) \
        + (went_on[3] - line.launched[1])
    restarting = bad["restart"] + bad["checkpoint_restore"]
    assert lo - slack <= restarting <= hi + slack, (lo, restarting, hi)
    assert 0.0 < bad["checkpoint_restore"] <= (went_on[2] - line.both) + (went_on[3] - line.launched[1])

    # start 1's launch: its Popen to rank 0's first step (imports, rendezvous, model build, first step)
    checked = [r["dataset_s"] or 0.0 for r in records(run_dir, "timeline") if r["event"] == "start"][1]
    startup = bad["launch"] + bad["dataset"] - checked + bad["rendezvous"] + bad["warmup"]  # not start 2's check
    assert steps0[0][0] - line.launched[0] - 0.5 <= startup <= steps0[0][0] - line.launched[0] + 0.05
    assert bad["launch"] > 0 and bad["warmup"] > 0

    # the loop's blocked saves: rank 0's phase `checkpoint` to its next record
    mine = sorted((r["time"], r.get("name")) for r in records(run_dir, "phase") if r["rank"] == 0)
    mine += [(at, None) for at, _ in steps0] + [(r["time"], None) for r in records(run_dir, "checkpoint")
                                                 if r["rank"] == 0]
    mine.sort()
    saves = [(a, b) for (a, name), (b, _) in zip(mine, mine[1:]) if name == "checkpoint"]
    # less any part of a save inside a fault's window (from the last step before it to training going
    # on): a save that waits there for a lost or stopped peer is the fault's time, not the save's
    lost_windows = [*zip(before, went_on[:3]), (line.launched[1], went_on[3])]
    blocked = sum(_outside(a, b, lost_windows) for a, b in saves)
    assert bad["checkpoint_save"] == pytest.approx(blocked, abs=0.2 + 0.1 * len(saves))

    # steps redone: the restart's, from the checkpoint it resumed from to the failure; each live
    # recovery's at the median step
    kept = int(first["attempts"][1]["resumed_from"].rsplit("_", 1)[1].removesuffix(".pt"))
    kept_at = max(at for at, s in steps0 if s == kept - 1 and at < line.both)
    in_saves = sum(min(b, line.both) - max(a, kept_at) for a, b in saves if a < line.both and b > kept_at)
    redo = sum(b - a for a, b in clean if a >= kept_at and b <= failed_at) - in_saves
    live = sum(r["steps_redone"] for r in recoveries) * step_s
    assert redo - slack <= bad["redone"] <= redo + 2 * live + slack, (redo, bad["redone"], live)

    # productive: every clean interval of rank 0, less what was redone and the saves within them
    trained = sum(b - a for a, b in clean)
    blocked = sum(b - a for a, b in saves if any(x <= a < y for x, y in clean))
    assert g["productive_s"] + bad["redone"] + blocked == pytest.approx(trained, abs=slack + 2 * step_s)

    # nothing else happened: no eval, no stop-and-continue (the hang's stretch is its detection)
    assert bad["eval"] == 0 and bad["sdc"] == 0 and bad["stopped"] <= 0.3
    tails = sum(end - _last_before(steps0, end) for end in line.exited)
    assert bad["other"] <= tails + 1.0
