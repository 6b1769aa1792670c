"""What reaches the user's terminal, written without ever blocking the supervisor.

The per-worker log files always get everything; only the console is thinned (router.py):
- lines that several ranks print alike are folded into one with their rank set (fold.py);
- `--log-ranks 0`: rank 0's lines plus every rank's warnings, errors and tracebacks.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections import deque

STDOUT, STDERR = 1, 2


class Console:
    """Writes whole batches of prefixed lines to fd 1 / fd 2, one writer thread per stream.

    The supervisor's loop never waits for the terminal: a terminal that stops reading
    (a paused pager, a stalled ssh session) would otherwise stop heartbeats, hang
    detection and teardown with it. Each stream has its own thread, so a stdout nobody
    reads never holds back stderr (the supervisor's own lines, the root-cause block).
    Batches wait in a bounded buffer per stream; when it is full, lines are left out of
    the console (never out of the log files) and the count is said once the terminal
    reads again. A closed terminal (`| head`) stops that stream, never the run."""

    MAX_PENDING = 16 << 20  # bytes waiting for one stream before lines are left out

    def __init__(self, max_pending: int = MAX_PENDING, notice_fd: int = STDERR) -> None:
        self.closed = False
        self.max_pending = max_pending
        self.notice_fd = notice_fd
        self.left_out = 0  # lines not shown, in all
        self._lanes: dict[int, _Lane] = {}
        self._lock = threading.Lock()  # writers: the main loop, and loguru from any thread

    def write(self, fd: int, data: bytes) -> None:
        if self.closed or not data:
            return
        with self._lock:
            lane = self._lanes.get(fd)
            if lane is None:
                lane = self._lanes[fd] = _Lane(fd, self.notice_fd)
            dropped = lane.put(data, self.max_pending)
            self.left_out += dropped

    def flush(self, timeout: float = 2.0) -> None:
        """Wait (at most `timeout` s on a stuck terminal) until what was written has been
        printed: a line written directly afterwards then comes after it."""
        deadline = time.monotonic() + timeout
        for lane in list(self._lanes.values()):
            lane.wait_printed(max(0.0, deadline - time.monotonic()))

    def close(self, timeout: float = 2.0) -> None:
        """Print what is waiting (at most `timeout` s on a stuck terminal), then stop."""
        deadline = time.monotonic() + timeout
        lanes = list(self._lanes.values())
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))
        self.closed = True


class _Lane:
    """One stream's queue and its writer thread."""

    def __init__(self, fd: int, notice_fd: int) -> None:
        self.fd, self.notice_fd = fd, notice_fd
        self.closed = False
        self._queue: deque[tuple[bytes | None, int]] = deque()  # (batch, 0) or (None, lines left out)
        self._pending = 0
        self._writing = False  # a batch taken off the queue is being written
        self._stopping = False
        self._cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"console-fd{fd}", daemon=True)
        self.thread.start()

    def put(self, data: bytes, max_pending: int) -> int:
        """Queue `data`; the number of lines left out instead when the buffer is full."""
        with self._cond:
            lines = 0
            if self._pending + len(data) <= max_pending:
                self._queue.append((data, 0))
                self._pending += len(data)
            elif self._queue and self._queue[-1][0] is None:
                lines = data.count(b"\n")
                self._queue[-1] = (None, self._queue[-1][1] + lines)
            else:
                lines = data.count(b"\n")
                self._queue.append((None, lines))
            self._cond.notify_all()
            return lines

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def wait_printed(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._queue and not self._writing, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                data, left_out = self._queue.popleft()
                self._writing = True
            if data is None:  # short: one atomic write even where another stream's thread writes to notice_fd
                self._emit(self.notice_fd, b"gpuherd: the console fell behind: %d line(s) not shown here "
                                           b"(every line is in the worker logs)\n" % left_out)
            else:
                self._emit(self.fd, data)
            with self._cond:
                self._pending -= len(data or b"")
                self._writing = False
                self._cond.notify_all()

    def _emit(self, fd: int, data: bytes) -> None:
        if self.closed:
            return
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:  # someone made the terminal non-blocking
                    select.select([], [fd], [], 1.0)
        except OSError:  # BrokenPipeError and the like: the terminal is gone
            self.closed = True
