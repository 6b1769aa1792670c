"""An attempt's worker pipes, read without blocking from one selector.

stdout and stderr become whole prefixed lines (the log router); the status pipe's
records are decoded (gpuherd/status_records.py: once, here), handed to `on_record` one by one, and appended to metrics.jsonl as
they came. A wake-up fd (signal handlers, watcher threads) shares the selector, so one
`wait` sleeps until a worker writes, a signal arrives or a thread has news. Each read
takes a bounded number of chunks, so one flooding worker cannot starve the others.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable
from typing import IO

from gpuherd.status_records import Record, Refusal, decode
from supervisor.output.console import STDERR, STDOUT
from supervisor.output.router import LogRouter

READ_CHUNK = 1 << 16
STATUS = "status"


class WorkerPipes:
    def __init__(self, router: LogRouter, on_record: Callable[[int, Record, float], None],
                 write_metrics: Callable[[bytes], None]) -> None:
        self.router = router
        self._on_record = on_record
        self._write_metrics = write_metrics
        self._sel = selectors.DefaultSelector()
        self._files: dict[tuple[int, int], IO[bytes]] = {}  # (rank, stream) -> the pipe's file object
        self._pending: dict[int, bytes] = {}  # a status record's first part, until its newline

    def add(self, rank: int, stdout: IO[bytes], stderr: IO[bytes], status_fd: int) -> None:
        for stream, f in ((STDOUT, stdout), (STDERR, stderr)):
            self._files[(rank, stream)] = f
            self._sel.register(f.fileno(), selectors.EVENT_READ, (rank, stream))
        self._sel.register(status_fd, selectors.EVENT_READ, (rank, STATUS))

    def wake_on(self, fd: int, drain: Callable[[], None]) -> None:
        """`fd` (the wake-up pipe) ends a wait too; `drain` empties it."""
        self._sel.register(fd, selectors.EVENT_READ, drain)

    def wait(self, timeout: float) -> None:
        """Until something is readable (or `timeout`): read what is there."""
        for key, _ in self._sel.select(timeout):
            if callable(key.data):
                key.data()
            else:
                self._read(key.fd, *key.data)

    def read_all(self, chunks: int) -> None:
        """Every open pipe, `chunks` reads at most each (after the supervisor itself was stopped)."""
        for key in self._pipes():
            self._read(key.fd, *key.data, limit=chunks)

    def drain(self, rank: int, chunks: int = 1024) -> None:
        """A dead worker's last words, before it is judged (bounded: a grandchild may still write)."""
        for key in self._pipes():
            if key.data[0] == rank:
                self._read(key.fd, *key.data, limit=chunks)

    def replace(self, rank: int, stdout: IO[bytes], stderr: IO[bytes], status_fd: int) -> None:
        """`rank` has a new process (a warm spare took it over): the old pipes, drained already,
        are closed, and the new ones read as the rank's from now on."""
        now = time.monotonic()
        for key in self._pipes():
            if key.data[0] == rank:
                self._close(key.fd, *key.data, now)
        self._pending.pop(rank, None)
        self.add(rank, stdout, stderr, status_fd)

    @property
    def open(self) -> bool:
        return bool(self._pipes())

    def close(self) -> None:
        """Read what is already in each pipe, then close them all."""
        now = time.monotonic()
        for key in self._pipes():
            self._read(key.fd, *key.data, limit=None)
            if key.fd in self._sel.get_map():
                self._close(key.fd, *key.data, now)
        self._sel.close()

    def _pipes(self) -> list[selectors.SelectorKey]:
        return [key for key in list(self._sel.get_map().values()) if isinstance(key.data, tuple)]

    def _read(self, fd: int, rank: int, stream: int | str, limit: int | None = 8) -> None:
        now = time.monotonic()
        reads = 0
        while limit is None or reads < limit:
            reads += 1
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._close(fd, rank, stream, now)
                return
            if stream == STATUS:
                self._status(rank, data, now)
            else:
                self.router.feed(rank, stream, data, now)
            if len(data) < READ_CHUNK:
                return

    def _close(self, fd: int, rank: int, stream: int | str, now: float) -> None:
        self._sel.unregister(fd)
        if stream == STATUS:
            os.close(fd)
        else:
            self.router.finish(rank, stream, now)
            self._files.pop((rank, stream)).close()

    def _status(self, rank: int, data: bytes, now: float) -> None:
        data = self._pending.pop(rank, b"") + data
        *lines, rest = data.split(b"\n")
        if rest:
            self._pending[rank] = rest
        good = []
        for line in lines:
            record = decode(line)
            if isinstance(record, Refusal):  # not a record: neither a sign of life nor a metric
                continue
            self._on_record(rank, record, now)
            good.append(line)
        if good:
            self._write_metrics(b"\n".join(good) + b"\n")

