"""What reaches the user's terminal: every line by default, or a filtered / collapsed view.

The per-worker log files always get everything; only the console is thinned.
- `--log-ranks 0`: rank 0's lines plus every rank's warnings, errors and tracebacks.
- `--collapse-logs`: a line that several ranks print identically (up to their own
  `[GPU n]` tag) is printed once with a rank count, so 8 GPUs read like one.
"""

from __future__ import annotations

import os
import re
import select
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

STDOUT, STDERR = 1, 2


class Console:
    """Writes whole batches of prefixed lines to fd 1 / fd 2 from a writer thread.

    The supervisor's loop never waits for the terminal: a terminal that stops reading
    (a paused pager, a stalled ssh session) would otherwise stop heartbeats, hang
    detection and teardown with it. Batches wait in a bounded buffer; when it is full,
    lines are left out of the console (never out of the log files) and the count is
    said once the terminal reads again. A closed terminal (`| head`) stops the console,
    never the run."""

    MAX_PENDING = 16 << 20  # bytes waiting for the terminal before lines are left out

    def __init__(self, max_pending: int = MAX_PENDING, notice_fd: int = STDERR) -> None:
        self.closed = False
        self.max_pending = max_pending
        self.notice_fd = notice_fd
        self.left_out = 0  # lines not shown, in all
        self._queue: deque[tuple[int, bytes | int]] = deque()  # (fd, batch) or (0, lines left out)
        self._pending = 0
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="console", daemon=True)
        self._thread.start()

    def write(self, fd: int, data: bytes) -> None:
        if self.closed or not data:
            return
        with self._cond:
            if self._pending + len(data) > self.max_pending:
                lines = data.count(b"\n")
                self.left_out += lines
                if self._queue and self._queue[-1][0] == 0:
                    self._queue[-1] = (0, self._queue[-1][1] + lines)
                else:
                    self._queue.append((0, lines))
            else:
                self._queue.append((fd, data))
                self._pending += len(data)
            self._cond.notify()

    def close(self, timeout: float = 2.0) -> None:
        """Print what is waiting (at most `timeout` s on a stuck terminal), then stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)
        self.closed = True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                fd, item = self._queue.popleft()
            if fd == 0:
                self._emit(self.notice_fd, b"gpuherd: the console fell behind: %d line(s) not shown here "
                                           b"(every line is in the worker logs)\n" % item)
                continue
            self._emit(fd, item)
            with self._cond:
                self._pending -= len(item)

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


_BRACKET = re.compile(rb"\[(GPU|CPU) (\d+)\]")


@dataclass
class _Group:
    fd: int
    key: bytes  # the line with the rank's own `[GPU n]` tag replaced by `[GPU *]`
    first_line: bytes  # the first rank's line, verbatim
    first_tag: str
    deadline: float
    tags: list[str] = field(default_factory=list)


class Collapser:
    """Holds each line up to `window` seconds for its twins from the other ranks."""

    def __init__(self, tags: list[str], window: float = 1.0) -> None:
        self._all = len(tags)
        self._kind = tags[0][:3].encode()
        self._window = window
        self._queue: OrderedDict[int, _Group] = OrderedDict()  # first-seen order
        self._open: dict[tuple[int, bytes], list[_Group]] = {}  # groups still collecting ranks
        self._seq = 0

    def add(self, fd: int, tag: str, line: bytes, now: float) -> None:
        device_id = tag[3:].encode()
        key = _BRACKET.sub(lambda m: b"[%s *]" % m.group(1) if m.group(2) == device_id else m.group(0), line)
        candidates = self._open.setdefault((fd, key), [])
        # A rank that prints the same line twice opens a second group for its second copy.
        group = next((g for g in candidates if tag not in g.tags), None)
        if group is None:
            group = _Group(fd, key, line, tag, now + self._window)
            candidates.append(group)
            self._queue[self._seq] = group
            self._seq += 1
        group.tags.append(tag)
        if len(group.tags) == self._all:
            group.deadline = now  # complete: no reason to wait
            candidates.remove(group)

    def due(self, now: float, everything: bool = False) -> list[tuple[int, bytes]]:
        """Groups ready to print, in first-seen order (a later group never jumps an earlier one)."""
        out = []
        while self._queue:
            seq, group = next(iter(self._queue.items()))
            if not everything and group.deadline > now:
                break
            del self._queue[seq]
            still_open = self._open.get((group.fd, group.key))
            if still_open and group in still_open:
                still_open.remove(group)
            if still_open == []:
                del self._open[(group.fd, group.key)]
            out.append((group.fd, self._render(group)))
        return out

    def next_deadline(self) -> float | None:
        return next(iter(self._queue.values())).deadline if self._queue else None

    def _render(self, group: _Group) -> bytes:
        if len(group.tags) == 1:
            return b"%s:%s\n" % (group.first_tag.encode(), group.first_line)
        if len(group.tags) == self._all:
            return b"%s*:%s [x%d ranks]\n" % (self._kind, group.key, len(group.tags))
        return b"%s*:%s [x%d ranks: %s]\n" % (self._kind, group.key, len(group.tags), ",".join(group.tags).encode())
