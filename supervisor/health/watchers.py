"""Run-scoped watchers: things that watch a run from threads and may end it.

The GPU watch (`gpu_watch.py`, around `supervisor.gpus.GpuMonitor`: NVML samples,
XID events, a lost GPU) is one. A watcher is started after the workers are spawned and stopped at
teardown; it may append records to `metrics.jsonl` and report a fatal cause, which
the supervisor treats like a worker's failure: teardown, and the cause's exit code
and message in the root-cause block and summary.json.

A watcher comes from a factory `(RunContext) -> RunWatcher | None` (None: it does
not apply, e.g. the GPU watch on a CPU-only run); the job starts each one it lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpuherd.config import Config
from gpuherd.status_records import Record
from supervisor.gpus import DevicePlan


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
    write_metric: Callable[[Record | dict[str, Any]], None]  # thread-safe; one JSON line in metrics.jsonl
    report_fatal: Callable[[FatalCause], None]  # thread-safe; the supervisor tears down


class RunWatcher(Protocol):
    name: str

    def start(self, ctx: RunContext) -> None: ...

    def stop(self) -> None: ...

