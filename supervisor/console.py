"""What reaches the user's terminal: every line by default, or a filtered / collapsed view.

The per-worker log files always get everything; only the console is thinned.
- `--log-ranks 0`: rank 0's lines plus every rank's warnings, errors and tracebacks.
- `--collapse-logs`: a line that several ranks print identically (up to their own
  `[GPU n]` tag) is printed once with a rank count, so 8 GPUs read like one.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

STDOUT, STDERR = 1, 2


class Console:
    """Writes whole batches of prefixed lines to fd 1 / fd 2; a closed terminal
    (`| head`) stops the console, never the run."""

    def __init__(self) -> None:
        self.closed = False

    def write(self, fd: int, data: bytes) -> None:
        if self.closed or not data:
            return
        view = memoryview(data)
        try:
            while view:
                try:
                    view = view[os.write(fd, view):]
                except BlockingIOError:
                    import select

                    select.select([], [fd], [], 1.0)
        except (BrokenPipeError, OSError):
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
