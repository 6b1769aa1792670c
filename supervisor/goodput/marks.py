"""The supervisor's own `timeline` records in `metrics.jsonl`: what the workers cannot say.

A start of the supervisor (with the dataset build's seconds, done before it), each attempt's
spawn and end (with the moment its failure was known), a rank the kernel shows stopped.
Monotonic times are turned into the wall clock every other record carries.
"""

from __future__ import annotations

import time
from typing import Any

import psutil

STOPS = ("terminated", "interrupted")  # a stop someone asked for: not a failure to detect


def wall(monotonic: float) -> float:
    return time.time() - (time.monotonic() - monotonic)


def start(number: int, started: float, dataset_s: float | None) -> dict[str, Any]:
    """`started`: the supervisor's own start (time.monotonic()). The start is the launcher
    process's creation when that is earlier: its interpreter and imports (seconds on a busy
    node) are the run's launch time too."""
    return {"type": "timeline", "event": "start", "time": min(wall(started), _process_created()), "start": number,
            "dataset_s": dataset_s}


def _process_created() -> float:
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return time.time()


def attempt(number: int, resumed: bool) -> dict[str, Any]:
    return {"type": "timeline", "event": "attempt", "time": time.time(), "attempt": number, "resumed": resumed}


def attempt_end(number: int, kind: str | None, failed_at: float | None) -> dict[str, Any]:
    """`kind`: the root cause's (None: success); `failed_at`: when the supervision knew (monotonic)."""
    failed = None if kind is None or kind in STOPS else wall(failed_at) if failed_at is not None else time.time()
    return {"type": "timeline", "event": "attempt_end", "time": time.time(), "attempt": number, "outcome": kind,
            "failed_at": failed}


def proc(rank: int, state: str, at: float) -> dict[str, Any]:
    """A rank's process entered state `state` (T: stopped) at `at` (monotonic)."""
    return {"type": "timeline", "event": "proc", "time": wall(at), "rank": rank, "state": state}
