"""The supervisor's own `timeline` records in `metrics.jsonl`: what the workers cannot say.

A start of the supervisor (with the dataset build's seconds, done before it), each attempt's
spawn and end (with the moment its failure was known), a rank the kernel shows stopped.
Monotonic times are turned into the wall clock every other record carries.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
import psutil

from gpuherd.status_records import TimelineAttempt, TimelineAttemptEnd, TimelineProc, TimelineStart, TimelineStraggler

STOPS = ("terminated", "interrupted")  # a stop someone asked for: not a failure to detect


def wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


def start(number: int, started: float, dataset_s: float | None) -> TimelineStart:
    """`started`: the supervisor's own start (time.monotonic()). The start is the launcher
    process's creation when that is earlier: its interpreter and imports (seconds on a busy
    node) are the run's launch time too."""
    return TimelineStart(time=min(wall(started), _process_created()), start=number, dataset_s=dataset_s)


def _process_created() -> float:
    """When this process was created, on the wall clock. Not psutil's create_time: that adds the
    boot time, which the kernel gives in whole seconds, so it is off by up to a second (the same
    way for every process since boot), and a start's wall time with it. The process's age from
    the boot clock is exact to a clock tick."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux: psutil's, to the second
        try:
            return psutil.Process().create_time()
        except psutil.Error:
            return time.time()


def attempt(number: int, resumed: bool, script: bool = False) -> TimelineAttempt:
    return TimelineAttempt(time=time.time(), attempt=number, resumed=resumed, script=script)


def attempt_end(number: int, kind: str | None, failed_at: float | None) -> TimelineAttemptEnd:
    """`kind`: the root cause's (None: success); `failed_at`: when the supervision knew (monotonic)."""
    failed = None if kind is None or kind in STOPS else wall(failed_at) if failed_at is not None else time.time()
    return TimelineAttemptEnd(time=time.time(), attempt=number, outcome=kind, failed_at=failed)


def proc(rank: int, state: str, at: float) -> TimelineProc:
    """A rank's process entered state `state` (T: stopped) at `at` (monotonic)."""
    return TimelineProc(time=wall(at), rank=rank, state=state)


def straggler(rank: int | None, since: float, at: float, lost_s: float, moved: bool,
              node: int | None = None) -> TimelineStraggler:
    """A named straggler's slow stretch ended at `at` (monotonic: back to pace, moved out, or the
    attempt's end): `lost_s` of the job's time went to its pace (the `straggler` badput). A whole
    node's (`node`, judged on node 0) has no rank."""
    return TimelineStraggler(time=wall(at), rank=rank, since=wall(since), lost_s=round(lost_s, 3), moved=moved,
                             node=node)
