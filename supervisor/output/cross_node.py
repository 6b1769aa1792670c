"""Lines that ranks on several nodes print alike -> one console line, on node 0.

Each node first folds its own ranks' lines (fold.py: `n3/GPU[0-7]: ...`). A multi-node job
then sends each such held group, instead of printing it, to node 0 as one record
(`Group`: the line, its node, its ranks and devices); node 0 merges the records of every
node that carry the same line within `gap` seconds of each other (at most `longest` after
the first) and prints it once with the compact range form `n[0-255]/r[0-2047]: ...`. A
line only one node printed keeps that node's own form (`n3/GPU[0-7]:`, or the one rank's
prefix).

Only what a node would have held reaches this point: errors (tracebacks among them), the
root cause and the per-rank step lines are printed where they happen, at once, and never
folded away; the per-rank log files are written before any folding. So 2,048 ranks that
print one warning cost node 0 one record per node (256 at 8 ranks a node) and the console
one line. What is held is bounded (`max_held` bytes): past it lines are printed sooner,
never kept.

The records travel as one JSON line each (`encode`/`decode`, bytes as latin-1 so any
output round-trips); the transport is the node agents' direct connection to node 0's
(rendezvous/liveness.py), so the job store carries none of it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from supervisor.output import rank_set


@dataclass(frozen=True)
class Group:
    """One node's folded line: what that node would print, with who printed it."""

    fd: int  # 1 stdout, 2 stderr
    node: int
    kind: str  # "GPU" | "CPU"
    devices: tuple[int, ...]
    ranks: tuple[int, ...]  # global ranks, in the order of `devices`
    key: bytes  # the line with each rank's own `[GPU n]` read as `[GPU *]` (what twins share)
    text: bytes  # a lone rank's line verbatim (printed as is when no other node has it)

    def render(self) -> bytes:
        """How this node alone prints it."""
        if len(self.ranks) == 1:
            return b"n%d/%s%d:" % (self.node, self.kind.encode(), self.devices[0]) + self.text + b"\n"
        return f"n{self.node}/{rank_set.devices(self.kind, self.devices)}:".encode() + self.key + b"\n"

    def as_record(self) -> dict[str, Any]:
        """The wire form: JSON-ready, bytes as latin-1 (any output round-trips)."""
        return {"fd": self.fd, "node": self.node, "kind": self.kind, "devices": self.devices, "ranks": self.ranks,
                "key": self.key.decode("latin-1"), "text": self.text.decode("latin-1")}

    def encode(self) -> bytes:
        return orjson.dumps(self.as_record())


def decode(raw: bytes | dict[str, Any]) -> Group | None:
    """A record as `Group.encode` writes it; None for anything else (it is left out, never a crash)."""
    try:
        d = orjson.loads(raw) if isinstance(raw, bytes | str) else raw
        devices, ranks = tuple(d["devices"]), tuple(d["ranks"])
        if not (d["fd"] in (1, 2) and isinstance(d["node"], int) and d["kind"] in ("GPU", "CPU") and ranks
                and len(devices) == len(ranks) and all(isinstance(i, int) for i in devices + ranks)):
            return None
        return Group(d["fd"], d["node"], d["kind"], devices, ranks, d["key"].encode("latin-1"),
                     d["text"].encode("latin-1"))
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeEncodeError):
        return None


@dataclass
class _Merged:
    fd: int
    key: bytes
    deadline: float
    last_chance: float
    groups: list[Group] = field(default_factory=list)
    nodes: set[int] = field(default_factory=set)
    ranks: int = 0
    open: bool = True


class CrossNodeFolder:
    """Node 0's folding point for every node's held lines."""

    def __init__(self, world_size: int, gap: float = 0.2, longest: float = 1.0, max_held: int = 4 << 20) -> None:
        self.world_size = world_size
        self._gap, self._longest, self._max_held = gap, longest, max_held
        self._queue: deque[_Merged] = deque()  # first-seen order
        self._open: dict[tuple[int, bytes], list[_Merged]] = {}
        self._held = 0

    def add(self, group: Group, now: float) -> None:
        candidates = self._open.setdefault((group.fd, group.key), [])
        # A node that sends the same line twice opens a second entry for its second copy.
        merged = next((m for m in candidates if group.node not in m.nodes), None)
        if merged is None:
            merged = _Merged(group.fd, group.key, now + self._gap, now + self._longest)
            candidates.append(merged)
            self._queue.append(merged)
            self._held += len(group.key)
        else:
            merged.deadline = min(now + self._gap, merged.last_chance)
        merged.groups.append(group)
        merged.nodes.add(group.node)
        merged.ranks += len(group.ranks)
        if merged.ranks >= self.world_size:
            merged.deadline = now  # every rank of the job said it: no reason to wait
            self._close(merged)

    def due(self, now: float, everything: bool = False) -> list[tuple[int, bytes]]:
        """(fd, line) ready to print, in first-seen order."""
        out = []
        while self._queue:
            merged = self._queue[0]
            if not everything and merged.deadline > now and self._held <= self._max_held:
                break
            self._queue.popleft()
            self._held -= len(merged.key)
            if merged.open:
                self._close(merged)
            out.append((merged.fd, _render(merged.groups)))
        return out

    def next_deadline(self) -> float | None:
        return self._queue[0].deadline if self._queue else None

    def _close(self, merged: _Merged) -> None:
        merged.open = False
        candidates = self._open[(merged.fd, merged.key)]
        candidates.remove(merged)
        if not candidates:
            del self._open[(merged.fd, merged.key)]


def _render(groups: Iterable[Group]) -> bytes:
    groups = list(groups)
    if len(groups) == 1:
        return groups[0].render()
    nodes = [g.node for g in groups for _ in g.ranks]
    ranks = [r for g in groups for r in g.ranks]
    return rank_set.node_ranks(nodes, ranks).encode() + b":" + groups[0].key + b"\n"


class FoldingPoint:
    """A multi-node job's end of the fold on each node: the node agent hands it every node's
    records (node 0's folds them all; any other node gets its own back only when it has no
    direct connection to node 0), and a small thread prints each merged line when it is due
    (it sleeps until the next deadline, or until a record comes while nothing is held), so no
    line waits on the supervision loop. `close` prints whatever is still held."""
    # Nodes start their workers at their own pace and each holds its lines 0.2 s first, so twins
    # from other nodes arrive later than a node's own: a line waits up to 1 s for the next node's
    # copy, at most 3 s in all, and is printed at once when every rank of the job said it.
    GAP_S, LONGEST_S = 1.0, 3.0

    def __init__(self, write: Callable[[int, bytes], None], world_size: int) -> None:
        self._write = write
        self.folder = CrossNodeFolder(world_size, gap=self.GAP_S, longest=self.LONGEST_S)
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="cross-node-fold", daemon=True)
        self._thread.start()

    def set_world_size(self, world_size: int) -> None:
        with self._lock:
            self.folder.world_size = world_size

    def receive(self, node: int, records: list[Any]) -> None:
        """From the agent link's reader thread; a record that does not decode is left out."""
        now = time.monotonic()
        with self._lock:
            for record in records:
                group = decode(record) if isinstance(record, dict) else None
                if group is not None:
                    self.folder.add(group, now)
            self._lock.notify()  # a new deadline, or a line every rank said: due now
        self._flush(everything=False)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=1.0)
        self._flush(everything=True)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                deadline = self.folder.next_deadline()
                self._lock.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._flush(everything=False)

    def _flush(self, everything: bool) -> None:
        with self._lock:
            lines = self.folder.due(time.monotonic(), everything=everything)
        for fd, line in lines:
            self._write(fd, line)
