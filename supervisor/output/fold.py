"""Identical lines from several ranks -> one console line naming the ranks that printed it.

Eight ranks, or 2,048, print the same warning within moments of each other; the console
shows it once, prefixed with the rank set in the compact form (`GPU[0-7]:` on one node,
`n3/GPU[0-7]:` for one node of a multi-node job, `n[0-255]/r[0-2047]:` across nodes).
"Identical" means equal after the device prefix, with the rank's own `[GPU n]` tag in the
message read as `[GPU *]` (the built-in trainer names its device in every line).

A line that may have twins is held until they came: at most `gap` seconds after the last
one arrived, at most `longest` after the first, and not at all once every rank printed it.
A lone line therefore waits `gap` (0.2 s), except a line of a kind only one rank prints: once
`LONE_AFTER` lines in a row of its shape (its digits read as one) came from that rank alone with
no twin, the next ones are not held (a script's per-step print on rank 0 shows at once); a
second rank printing that shape makes it held again. Lines that must not wait or fold (the caller's
choice: progress lines, errors) go through `add(..., hold=False)`: in order behind what is
held, never merged. Output keeps first-seen order, so no rank's lines ever change order.
What is held is bounded (`max_held` bytes): a flood of distinct lines is printed sooner,
never kept. Only the console is folded; the per-rank log files get every line as it came.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from supervisor.output import rank_set
from supervisor.output.cross_node import Group

LONE_AFTER = 3  # lines of one shape in a row, from one rank and never twinned, before it is not held
MAX_SHAPES = 4096  # shapes remembered (lines full of words that vary would grow it without end)
_DIGITS = re.compile(rb"\d+")


@dataclass
class _Shape:
    """What the folder learned of the lines that read alike once their numbers are ignored."""

    rank: int  # the one rank that printed lines of this shape (-1: more than one)
    lone: int = 0  # of its lines in a row, printed with no twin


@dataclass(frozen=True)
class Source:
    """One rank as the console names it."""

    prefix: bytes  # what precedes its lines unfolded: b"GPU3:", b"n2/GPU3:"
    kind: str  # "GPU" | "CPU"
    device: int  # the 3 of GPU3
    rank: int  # global rank
    node: int | None = None  # its node in a multi-node job; None on one node

    @property
    def own_tag(self) -> bytes:
        """How the built-in trainer names this rank's device inside a line: `[GPU 3]`."""
        return b"[%s %d]" % (self.kind.encode(), self.device)


@dataclass
class _Group:
    fd: int
    key: bytes  # the line with its rank's own `[GPU n]` read as `[GPU *]`
    first_line: bytes  # the first rank's line, verbatim (printed as is when no twin comes)
    deadline: float
    last_chance: float  # first seen + longest: the deadline never moves past it
    shape: _Shape | None = None
    members: list[Source] = field(default_factory=list)
    seen: set[int] = field(default_factory=set)  # the members' ranks
    open: bool = True  # still taking ranks


class LineFolder:
    def __init__(self, sources: Iterable[Source], gap: float = 0.2, longest: float = 1.0,
                 max_held: int = 4 << 20, relay: Callable[[Group], None] | None = None) -> None:
        """`relay`: a multi-node job's way to node 0's folding point (cross_node.py): each held
        group, once due, goes there instead of to the console (what is not held never does)."""
        self._relay = relay
        self._all = len({s.rank for s in sources})
        self._gap, self._longest, self._max_held = gap, longest, max_held
        self._queue: deque[_Group | tuple[int, bytes]] = deque()  # first-seen order; (fd, line): not held
        self._open: dict[tuple[int, bytes], list[_Group]] = {}  # groups still taking ranks
        self._stars: dict[int, tuple[bytes, bytes]] = {}  # rank -> its own tag, and the same starred
        self._held = 0  # bytes of first lines queued
        self._shapes: dict[tuple[int, bytes], _Shape] = {}

    def add(self, fd: int, source: Source, line: bytes, now: float, hold: bool = True) -> None:
        if not hold:  # due at once, behind what is held: a plain (fd, line) is all it needs
            self._queue.append((fd, source.prefix + line + b"\n"))
            return
        stars = self._stars.get(source.rank)
        if stars is None:
            own = source.own_tag
            stars = self._stars[source.rank] = (own, own.replace(str(source.device).encode() + b"]", b"*]"))
        key = line.replace(stars[0], stars[1]) if stars[0] in line else line
        shape = self._shape(fd, key, source.rank)
        if shape.lone >= LONE_AFTER and (self._relay is None or fd != 2):  # no twin ever came: show it now
            self._queue.append((fd, source.prefix + line + b"\n"))
            return
        candidates = self._open.get((fd, key))
        if candidates is None:
            candidates = self._open[(fd, key)] = []
        # A rank that prints the same line twice opens a second group for its second copy.
        group = next((g for g in candidates if source.rank not in g.seen), None)
        if group is None:
            group = _Group(fd, key, line, now + self._gap, now + self._longest, shape)
            candidates.append(group)
            self._enqueue(group)
        else:
            group.deadline = min(now + self._gap, group.last_chance)
        group.members.append(source)
        group.seen.add(source.rank)
        if len(group.members) == self._all:
            group.deadline = now  # every rank said it: no reason to wait
            self._close(group)

    def due(self, now: float, everything: bool = False) -> list[tuple[int, bytes]]:
        """(fd, line) ready to print, in first-seen order (a later line never jumps an earlier one)."""
        out = []
        queue = self._queue
        while queue:
            group = queue[0]
            if type(group) is tuple:
                out.append(queue.popleft())
                continue
            if not everything and group.deadline > now and self._held <= self._max_held:
                break
            queue.popleft()
            self._held -= len(group.first_line)
            if group.open:
                self._close(group)
            if group.shape is not None:
                group.shape.lone = group.shape.lone + 1 if len(group.members) == 1 else 0
            # stderr (warnings, logs) folds across nodes; stdout is a program's output and stays
            # on its node, as under torchrun
            if self._relay is not None and group.members[0].node is not None and group.fd == 2:
                self._relay(_as_group(group))
                continue
            out.append((group.fd, _render(group)))
        return out

    def next_deadline(self) -> float | None:
        if not self._queue:
            return None
        head = self._queue[0]
        return 0.0 if type(head) is tuple else head.deadline

    def _shape(self, fd: int, key: bytes, rank: int) -> _Shape:
        """The shape of `key` as learned so far, with `rank` seen printing it."""
        name = (fd, _DIGITS.sub(b"#", key))
        shape = self._shapes.get(name)
        if shape is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[name] = _Shape(rank)
        elif shape.rank != rank:
            shape.rank, shape.lone = -1, 0  # more than one rank prints it: its lines may have twins
        return shape

    def _enqueue(self, group: _Group) -> None:
        self._queue.append(group)
        self._held += len(group.first_line)

    def _close(self, group: _Group) -> None:
        group.open = False
        candidates = self._open[(group.fd, group.key)]
        candidates.remove(group)
        if not candidates:
            del self._open[(group.fd, group.key)]


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


def _as_group(group: _Group) -> Group:
    """A held group as node 0's folding point receives it (every member is on this node)."""
    first = group.members[0]
    return Group(group.fd, first.node, first.kind, tuple(m.device for m in group.members),
                 tuple(m.rank for m in group.members), group.key, group.first_line)
