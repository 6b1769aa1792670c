"""Worker output -> `GPUn:`-prefixed lines on the console and in one file per worker.

Every chunk read from a pipe becomes whole lines (`LineSplitter`), each written
with its prefix in one write per batch, unbuffered: what a worker printed before
it died is in its file even if the supervisor is killed a moment later.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from gpuherd.log_writes import LOG_WRITES
from supervisor.output.console import STDERR, STDOUT, Collapser, Console
from supervisor.health import NcclTransportWatch
from supervisor.output.lines import LineSplitter, Severity

TAIL_LINES = 20


@dataclass
class _Stream:
    fd: int  # where its lines go on the console: 1 (stdout) or 2 (stderr)
    splitter: LineSplitter = field(default_factory=LineSplitter)
    severity: Severity = field(default_factory=Severity)


class WorkerLog:
    def __init__(self, rank: int, tag: str, path: Path, prefix: str | None = None) -> None:
        """`prefix`: what precedes each line (default `{tag}:`, e.g. `GPU3:`; torchrun's
        TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE gives another)."""
        self.rank = rank
        self.tag = tag
        self.prefix = (f"{tag}:" if prefix is None else prefix).encode()
        self.path = path
        self._file = LOG_WRITES.open(path)  # never through a planted symlink; None: its disk refused it
        self.streams = {STDOUT: _Stream(STDOUT), STDERR: _Stream(STDERR)}
        self.stderr_tail: deque[bytes] = deque(maxlen=TAIL_LINES)
        self.lines = 0

    def write_file(self, data: bytes) -> None:
        LOG_WRITES.write(self._file, data, self.path)  # a full log disk drops the line (counted), never the run

    def close(self) -> None:
        if self._file is not None:
            os.close(self._file)


class LogRouter:
    def __init__(self, logs: list[WorkerLog], console: Console, log_ranks: list[int] | None = None,
                 collapse: bool = False, nccl_watch: NcclTransportWatch | None = None) -> None:
        self.logs = {log.rank: log for log in logs}
        self._nccl = nccl_watch  # NCCL_DEBUG=INFO: the transports NCCL chose, warned about when slow
        self.console = console
        self._shown = set(log_ranks) if log_ranks is not None else None
        self._collapser = Collapser([log.tag for log in logs]) if collapse and len(logs) > 1 else None

    def feed(self, rank: int, fd: int, data: bytes, now: float) -> None:
        log = self.logs[rank]
        self._route(log, fd, log.streams[fd].splitter.feed(data, now), now)

    def finish(self, rank: int, fd: int, now: float) -> None:
        """The pipe hit EOF: flush a last line that had no newline."""
        log = self.logs[rank]
        self._route(log, fd, log.streams[fd].splitter.finish(), now)

    def tick(self, now: float, everything: bool = False) -> None:
        if self._collapser is not None:
            for fd, data in self._collapser.due(now, everything):
                self.console.write(fd, data)

    def next_deadline(self) -> float | None:
        return self._collapser.next_deadline() if self._collapser is not None else None

    def _route(self, log: WorkerLog, fd: int, lines: list[bytes], now: float) -> None:
        if not lines:
            return
        log.lines += len(lines)
        prefix = log.prefix
        block = prefix + (b"\n" + prefix).join(lines) + b"\n"
        log.write_file(block)
        if self._nccl is not None and b"NCCL INFO Channel" in block:
            self._check_nccl(lines)
        if fd == STDERR:
            log.stderr_tail.extend(lines[-TAIL_LINES:])
        if self._shown is None and self._collapser is None:
            self.console.write(fd, block)  # the fast path: no per-line work at all
            return
        if self._shown is not None and log.rank not in self._shown:
            severity = log.streams[fd].severity
            lines = [line for line in lines if severity.loud(line)]
        if self._collapser is None:
            if lines:
                self.console.write(fd, prefix + (b"\n" + prefix).join(lines) + b"\n")
            return
        for line in lines:
            self._collapser.add(fd, log.tag, line, now)
        self.tick(now)

    def _check_nccl(self, lines: list[bytes]) -> None:
        for line in lines:
            if b"NCCL INFO Channel" in line:
                warning = self._nccl.feed(line.decode(errors="replace"))
                if warning:
                    logger.warning(warning)

    def close(self) -> None:
        """The attempt's files; the console outlives it (the supervisor's, closed by its owner)."""
        self.tick(0.0, everything=True)
        for log in self.logs.values():
            log.close()
