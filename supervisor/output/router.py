"""Worker output -> `GPUn:`-prefixed lines on the console and in one file per worker.

Every chunk read from a pipe becomes whole lines (`LineSplitter`), each written
with its prefix in one write per batch, unbuffered: what a worker printed before
it died is in its file even if the supervisor is killed a moment later.
The console folds what several ranks print alike into one line with their rank set
(fold.py); step lines and errors are never folded (`--collapse-logs` folds step lines too).
"""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from gpuherd.log_writes import LOG_WRITES
from supervisor.health import NcclTransportWatch
from supervisor.output.console import STDERR, STDOUT, Console
from supervisor.output.cross_node import Group
from supervisor.output.fold import LineFolder, Source
from supervisor.output.lines import ERROR, QUIET, LineSplitter, Severity, is_progress, may_be_progress

TAIL_LINES = 20
FLOOD_LINES = 256  # lines in one read of one pipe: printed as they are, not folded


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
                 collapse: bool = False, nccl_watch: NcclTransportWatch | None = None,
                 relay: Callable[[Group], None] | None = None) -> None:
        """`collapse` (`--collapse-logs`): step lines are folded too. `relay` (a multi-node job):
        where this node's held lines go to be folded with the other nodes' (cross_node.py)."""
        self.logs = {log.rank: log for log in logs}
        self._nccl = nccl_watch  # NCCL_DEBUG=INFO: the transports NCCL chose, warned about when slow
        self.console = console
        self._shown = set(log_ranks) if log_ranks is not None else None
        self._fold_progress = collapse
        named = {log.rank: _source(log) for log in logs}
        foldable = (len(logs) > 1 or relay is not None) and None not in named.values()
        self._sources = {rank: s for rank, s in named.items() if s is not None} if foldable else {}
        # Asked for (`--collapse-logs`): each line waits up to a second for its twins, since ranks
        # rarely print their step lines within 0.2 s of each other; by default a lone line waits 0.2 s.
        gap = 1.0 if collapse else 0.2
        self._folder = LineFolder(self._sources.values(), gap=gap, longest=max(gap, 1.0),
                                  relay=relay) if foldable else None

    def feed(self, rank: int, fd: int, data: bytes, now: float) -> None:
        log = self.logs[rank]
        self._route(log, fd, log.streams[fd].splitter.feed(data, now), now)

    def finish(self, rank: int, fd: int, now: float) -> None:
        """The pipe hit EOF: flush a last line that had no newline."""
        log = self.logs[rank]
        self._route(log, fd, log.streams[fd].splitter.finish(), now)

    def tick(self, now: float, everything: bool = False) -> None:
        if self._folder is None:
            return
        by_fd: dict[int, list[bytes]] = {}
        for fd, data in self._folder.due(now, everything):
            by_fd.setdefault(fd, []).append(data)
        for fd, parts in by_fd.items():
            self.console.write(fd, b"".join(parts))

    def next_deadline(self) -> float | None:
        return self._folder.next_deadline() if self._folder is not None else None

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
        if self._shown is None and (self._folder is None or len(lines) > FLOOD_LINES):
            # One rank, the user's own prefix, or a flood (no reader follows hundreds of lines
            # at once, and folding them line by line would slow the supervisor to the flood's
            # pace): no per-line work at all, after whatever was held.
            self.tick(now, everything=True)
            self.console.write(fd, block)
            return
        severity = log.streams[fd].severity
        filtered = self._shown is not None and log.rank not in self._shown
        if filtered or severity.may_be_error(block):
            levels = [severity.level(line) for line in lines]
        else:  # the common batch: no line of it can be an error, so none is looked at one by one
            levels = [QUIET] * len(lines)
        if filtered:  # another rank's: only its warnings and errors reach the console
            lines, levels = [ln for ln, lv in zip(lines, levels) if lv], [lv for lv in levels if lv]
        if self._folder is None:
            if lines:
                self.console.write(fd, prefix + (b"\n" + prefix).join(lines) + b"\n")
            return
        source, add = self._sources[log.rank], self._folder.add
        progress = not self._fold_progress and may_be_progress(block)
        urgent = False
        for line, level in zip(lines, levels):
            # Errors (tracebacks among them) and every rank's step line are shown as printed.
            hold = level != ERROR and not (progress and is_progress(line))
            add(fd, source, line, now, hold)
            urgent = urgent or level == ERROR
        self.tick(now, everything=urgent)  # an error is shown at once, with what was held before it

    def _check_nccl(self, lines: list[bytes]) -> None:
        for line in lines:
            if b"NCCL INFO Channel" in line:
                warning = self._nccl.feed(line.decode(errors="replace"))
                if warning:
                    logger.warning(warning)

    def close(self) -> None:
        """Whatever the console still holds, then the attempt's files; the console outlives
        the attempt (the supervisor's, closed by its owner)."""
        self.tick(0.0, everything=True)
        for log in self.logs.values():
            log.close()


_OWN_PREFIX = re.compile(r"^(?:n(\d+)/)?(GPU|CPU)(\d+):$")


def _source(log: WorkerLog) -> Source | None:
    """How the console names this rank when folding, from the prefix the supervisor gave it
    (`GPU3:`, `n2/GPU3:`); None for another one (torchrun's prefix template is the user's
    own line format: their lines are shown as they come, not folded)."""
    m = _OWN_PREFIX.match(log.prefix.decode(errors="replace"))
    if m is None or m.group(2) + m.group(3) != log.tag:
        return None
    return Source(log.prefix, m.group(2), int(m.group(3)), log.rank, int(m.group(1)) if m.group(1) else None)
