"""Run-scoped watchers: things that watch a run from threads and may end it.

The GPU monitor (`supervisor/gpus/monitor.py`: NVML samples, XID events, a lost
GPU) is one. A watcher is started after the workers are spawned and stopped at
teardown; it may append records to `metrics.jsonl` and report a fatal cause, which
the supervisor treats like a worker's failure: teardown, and the cause's exit code
and message in the root-cause block and summary.json.

To add one, append a factory to `WATCHER_FACTORIES` (it may return None when it
does not apply, e.g. on a CPU-only run).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from gpuherd.config import Config
from supervisor.devices import DevicePlan


@dataclass(frozen=True)
class FatalCause:
    name: str  # short id, e.g. "gpu-xid", "gpu-lost"
    exit_code: int  # gpuherd.exit_codes.ExitCode.DEVICE for hardware
    message: str  # one line for the user
    rank: int | None = None  # the worker it concerns, if any


@dataclass(frozen=True)
class RunContext:
    config: Config
    plan: DevicePlan
    run_dir: Path
    pids: dict[int, int]  # rank -> worker pid
    write_metric: Callable[[dict[str, Any]], None]  # thread-safe; one JSON line in metrics.jsonl
    report_fatal: Callable[[FatalCause], None]  # thread-safe; the supervisor tears down


class RunWatcher(Protocol):
    name: str

    def start(self, ctx: RunContext) -> None: ...

    def stop(self) -> None: ...


WATCHER_FACTORIES: list[Callable[[RunContext], RunWatcher | None]] = []


class MetricsSink:
    """`metrics.jsonl`, appended from the loop and from watcher threads alike: each record
    is one O_APPEND write, so lines never tear or interleave."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write_lines(self, data: bytes) -> None:
        if data:
            os.write(self._fd, data)

    def write(self, record: dict[str, Any]) -> None:
        self.write_lines(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    def close(self) -> None:
        os.close(self._fd)
