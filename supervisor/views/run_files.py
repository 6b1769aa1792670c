"""A run's files, read while the run may still be writing them.

The viewers (`top`, `report`) never talk to the supervisor or the workers: they
read `logs/<run-id>/` only, so looking at a run can never stall it. The
supervisor appends `metrics.jsonl` and `supervisor.log` line by line; a reader
can therefore meet a last line that is only half written. `JsonlTail` and
`LogTail` keep such a fragment back until its newline arrives, and skip (and
count) a line that is not valid JSON instead of failing on it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gpuherd.bounded_read import NotAFile, open_regular, read_bounded
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Record, Refusal, Refused, decode
from supervisor.views.summary_file import SummaryFile, read_summary

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.json"
SUPERVISOR_LOG = "supervisor.log"
RUN_MARKERS = (CONFIG, METRICS, SUMMARY)  # a directory with none of these is no gpuherd run
MAX_JSON_BYTES = 64 << 20  # config.json: a resolved config is a few KiB

_WORKER_LOG = re.compile(r"^worker-rank(\d+)-(\w+)\.log$")
# supervisor.log lines: "2026-11-23 01:17:32.031 WARNING | message"
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+) (\w+) \| (.*)$")


class RunFilesError(GpuherdError):
    """RUN names no run directory: the user's input is wrong (exit 2)."""

    exit_code = ExitCode.USAGE


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_MARKERS)


def resolve_run(run: str | None, run_root: Path) -> Path:
    """RUN as the user typed it: a run directory, or a run id under `run_root`;
    None means the newest run under `run_root` (by the time its config was written)."""
    if run is None:
        runs = [p for p in run_root.iterdir() if is_run_dir(p)] if run_root.is_dir() else []
        if not runs:
            raise RunFilesError(f"no run found under {run_root} (give RUN: a run directory or a run id)")
        return max(runs, key=_started)
    for candidate in (Path(run), run_root / run):
        if is_run_dir(candidate):
            return candidate.resolve()
    if Path(run).is_dir():
        raise RunFilesError(f"{run} is not a gpuherd run directory (no {', '.join(RUN_MARKERS)})")
    raise RunFilesError(f"run {run!r} not found (neither a directory nor a run id under {run_root})")


def _started(run_dir: Path) -> float:
    for name in RUN_MARKERS:
        try:
            return (run_dir / name).stat().st_mtime
        except OSError:
            continue
    return run_dir.stat().st_mtime


class _LineTail:
    """Whole lines appended to a file since the last call; a fragment without its
    newline yet is kept for the next call. A file that shrank was replaced: start over.
    Read `CHUNK` bytes at a time, so a run's gigabyte of metrics never sits in memory at once."""

    CHUNK = 4 << 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.unreadable: str | None = None  # what the file is instead of a regular one (a named pipe)

    def read_lines(self) -> list[bytes]:
        return [line for chunk in self.each_chunk() for line in chunk]

    def each_chunk(self) -> Iterator[list[bytes]]:
        """The new whole lines, a chunk's worth at a time."""
        try:
            handle = open_regular(self.path)  # a named pipe would block the view for good
        except NotAFile as exc:
            self.unreadable = str(exc)
            return
        except OSError:
            return
        with handle:
            try:
                handle.seek(0, 2)
                if handle.tell() < self._offset:
                    self._offset, self._partial = 0, b""
                handle.seek(self._offset)
            except OSError:
                return
            while True:
                try:
                    data = handle.read(self.CHUNK)
                except OSError:
                    return
                if not data:
                    return
                self._offset += len(data)
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()
                yield [line for line in lines if line.strip()]


def readable(line: bytes) -> Record | Refusal | None:
    """One metrics.jsonl line as the views use it: its record; a refusal when it is unreadable
    (not JSON, not an object, or a field of the wrong type: `"step": "x"`, `"time": 1e300`),
    so no view meets a half-checked record later; None for a type no view knows (the
    supervisor's own bookkeeping: `goodput`, `requeue`)."""
    record = decode(line, supervisor=True)
    if isinstance(record, Refusal):
        return None if record.why is Refused.UNKNOWN_TYPE else record
    return Refusal(Refused.MALFORMED_FIELD, ", ".join(record.refused)) if record.refused else record


class JsonlTail(_LineTail):
    """metrics.jsonl: one typed record per complete line; unreadable lines are counted, not fatal."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.malformed = 0

    def read_new(self) -> list[Record]:
        return list(self.each_new())

    def each_new(self) -> Iterator[Record]:
        for chunk in self.each_chunk():
            for line in chunk:
                record = readable(line)
                if isinstance(record, Refusal):
                    self.malformed += 1
                elif record is not None:
                    yield record


@dataclass(frozen=True)
class LogLine:
    when: str  # "2026-11-23 01:17:32.031"
    level: str  # WARNING | ERROR | ...
    message: str


class LogTail(_LineTail):
    """supervisor.log: its warning and error lines (what the footer and the timeline show)."""

    LEVELS = frozenset({"WARNING", "ERROR", "CRITICAL"})

    def read_new(self) -> list[LogLine]:
        found = []
        for raw in self.read_lines():
            match = _LOG_LINE.match(raw.decode("utf-8", "replace"))
            if match and match.group(2) in self.LEVELS:
                found.append(LogLine(*match.groups()))
        return found


def read_json(path: Path) -> dict[str, Any] | None:
    """config.json, or None while it is missing, not valid JSON (written atomically: damaged,
    never half-written), no regular file (a named pipe would block, a device never end) or
    larger than MAX_JSON_BYTES."""
    try:
        value = orjson.loads(read_bounded(path, MAX_JSON_BYTES))
    except (OSError, orjson.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def worker_devices(run_dir: Path) -> dict[int, str]:
    """rank -> device tag (`GPU3`, `CPU0`) from the worker log names, the newest attempt last."""
    found: dict[int, str] = {}
    for folder in [run_dir, *sorted(run_dir.glob("attempt-*"), key=_attempt_number)]:
        for path in folder.glob("worker-rank*.log"):
            match = _WORKER_LOG.match(path.name)
            if match:
                found[int(match.group(1))] = match.group(2)
    return found


def _attempt_number(path: Path) -> int:
    suffix = path.name.rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else 0


@dataclass
class RunFiles:
    """Everything a viewer reads from one run directory, refreshed by `poll()`."""

    run_dir: Path
    records: list[Record] = field(default_factory=list)  # every metrics record so far, in file order
    keep_records: bool = True  # False: `records` stays empty (a view that folds each record in as it comes)
    warnings: list[LogLine] = field(default_factory=list)
    summary: dict[str, Any] | None = None  # summary.json's checked fields (summary_file.py); None: none yet
    summary_file: SummaryFile = field(default_factory=SummaryFile)  # ... and what of it was skipped
    config: dict[str, Any] | None = None
    devices: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._metrics = JsonlTail(self.run_dir / METRICS)
        self._log = LogTail(self.run_dir / SUPERVISOR_LOG)

    @property
    def malformed(self) -> int:
        return self._metrics.malformed

    @property
    def not_read(self) -> list[str]:
        """`metrics.jsonl (a named pipe)`: the appended files that are no regular file, left unread."""
        return [f"{tail.path.name} ({tail.unreadable})" for tail in (self._metrics, self._log) if tail.unreadable]

    def poll(self) -> list[Record]:
        """Read what was appended since the last poll; returns the new metrics records."""
        return list(self.poll_each())

    def poll_each(self) -> Iterator[Record]:
        """`poll`, one record at a time: the memory a reader needs is its own, not the file's."""
        if self.config is None:  # first: a step's time per step needs the config
            self.config = read_json(self.run_dir / CONFIG)
        for record in self._metrics.each_new():
            if self.keep_records:
                self.records.append(record)
            yield record
        self.warnings += self._log.read_new()
        if self.summary is None:
            self.summary_file = read_summary(self.run_dir / SUMMARY)
            self.summary = self.summary_file.values
        self.devices = worker_devices(self.run_dir)

    def started(self) -> float:
        """When the run began: the supervisor writes config.json first."""
        return _started(self.run_dir)
