"""Identical lines from several ranks -> one console line naming the ranks that printed it.

Eight ranks, or 2,048, print the same warning within moments of each other; the console
shows it once, prefixed with the rank set in the compact form (`GPU[0-7]:` on one node,
`n3/GPU[0-7]:` for one node of a multi-node job, `n[0-255]/r[0-2047]:` across nodes).
"Identical" means equal after the device prefix, with the rank's own `[GPU n]` tag in the
message read as `[GPU *]` (the built-in trainer names its device in every line).

A line that may have twins is held until they came: at most `gap` seconds after the last
one arrived, at most `longest` after the first, and not at all once every rank printed it.
A lone line therefore waits `gap` (0.2 s). Lines that must not wait or fold (the caller's
choice: progress lines, errors) go through `add(..., hold=False)`: in order behind what is
held, never merged. Output keeps first-seen order, so no rank's lines ever change order.
What is held is bounded (`max_held` bytes): a flood of distinct lines is printed sooner,
never kept. Only the console is folded; the per-rank log files get every line as it came.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from supervisor.output import rank_set

_BRACKET = re.compile(rb"\[(GPU|CPU) (\d+)\]")


@dataclass(frozen=True)
class Source:
    """One rank as the console names it."""

    prefix: bytes  # what precedes its lines unfolded: b"GPU3:", b"n2/GPU3:"
    kind: str  # "GPU" | "CPU"
    device: int  # the 3 of GPU3
    rank: int  # global rank
    node: int | None = None  # its node in a multi-node job; None on one node


@dataclass
class _Group:
    fd: int
    key: bytes  # the line with its rank's own `[GPU n]` read as `[GPU *]`
    first_line: bytes  # the first rank's line, verbatim (printed as is when no twin comes)
    deadline: float
    last_chance: float  # first seen + longest: the deadline never moves past it
    members: list[Source] = field(default_factory=list)
    seen: set[Source] = field(default_factory=set)


class LineFolder:
    def __init__(self, sources: Iterable[Source], gap: float = 0.2, longest: float = 1.0,
                 max_held: int = 4 << 20) -> None:
        self._all = len(set(sources))
        self._gap, self._longest, self._max_held = gap, longest, max_held
        self._queue: OrderedDict[int, _Group] = OrderedDict()  # first-seen order
        self._open: dict[tuple[int, bytes], list[_Group]] = {}  # groups still taking ranks
        self._seq = 0
        self._held = 0  # bytes of first lines queued

    def add(self, fd: int, source: Source, line: bytes, now: float, hold: bool = True) -> None:
        if not hold:
            self._enqueue(_Group(fd, b"", line, now, now, [source]))
            return
        key = _own_tag_starred(source, line)
        candidates = self._open.setdefault((fd, key), [])
        # A rank that prints the same line twice opens a second group for its second copy.
        group = next((g for g in candidates if source not in g.seen), None)
        if group is None:
            group = _Group(fd, key, line, now + self._gap, now + self._longest)
            candidates.append(group)
            self._enqueue(group)
        else:
            group.deadline = min(now + self._gap, group.last_chance)
        group.members.append(source)
        group.seen.add(source)
        if len(group.members) == self._all:
            group.deadline = now  # every rank said it: no reason to wait
            candidates.remove(group)
            if not candidates:
                del self._open[(fd, key)]

    def due(self, now: float, everything: bool = False) -> list[tuple[int, bytes]]:
        """(fd, line) ready to print, in first-seen order (a later line never jumps an earlier one)."""
        out = []
        while self._queue:
            seq, group = next(iter(self._queue.items()))
            if not everything and group.deadline > now and self._held <= self._max_held:
                break
            del self._queue[seq]
            self._held -= len(group.first_line)
            still_open = self._open.get((group.fd, group.key))
            if still_open and group in still_open:
                still_open.remove(group)
                if not still_open:
                    del self._open[(group.fd, group.key)]
            out.append((group.fd, _render(group)))
        return out

    def next_deadline(self) -> float | None:
        return next(iter(self._queue.values())).deadline if self._queue else None

    def _enqueue(self, group: _Group) -> None:
        self._queue[self._seq] = group
        self._seq += 1
        self._held += len(group.first_line)


def _own_tag_starred(source: Source, line: bytes) -> bytes:
    if b"[" not in line:
        return line
    own = str(source.device).encode()
    return _BRACKET.sub(lambda m: b"[%s *]" % m.group(1) if m.group(2) == own else m.group(0), line)


def who(members: list[Source]) -> str:
    """The rank set of a folded line: `GPU[0-7]`, `n3/GPU[0-7]`, `n[0-255]/r[0-2047]`."""
    nodes = {m.node for m in members}
    if len(nodes) > 1:
        return rank_set.node_ranks((m.node or 0 for m in members), (m.rank for m in members))
    node = nodes.pop()
    devices = rank_set.devices(members[0].kind, (m.device for m in members))
    return devices if node is None else f"n{node}/{devices}"


def _render(group: _Group) -> bytes:
    if len(group.members) == 1:
        return group.members[0].prefix + group.first_line + b"\n"
    return who(group.members).encode() + b":" + group.key + b"\n"
