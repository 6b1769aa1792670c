"""The job store's keys per attempt, and node 0's one watch over every node's heartbeat.

Every node writes its own beat key once a second (one request); node 0 alone reads them
all, in one `multi_get` per second, and publishes one verdict (`a{k}/verdict`, verdict.py:
a few dozen bytes however many nodes) that any node reads when it has to know who is alive.
So the store serves about one request per node per second however many nodes there are (the
old way, each node reading every other node's keys, grew with the square of the nodes and
saturated the store near 100).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

from supervisor.rendezvous.verdict import summary

BEAT_S = 1.0  # each agent sets its beat key this often while an attempt runs; node 0 reads them all as often
# ... and this often while an `alive` check is pending on the node (every node checks after an
# ordinary worker failure): the check needs each node's beat seen moving in two of node 0's
# readings after it began, which at BEAT_S took 2-3 s of every multi-node restart
CHECK_BEAT_S = 0.25
# a beat that stood still this long at node 0's latest reading is `late` in the verdict (its seq
# listed): two missed beats at BEAT_S, whatever node 0's own reading pace (verdict.py)
LATE_S = 1.5 * BEAT_S
SILENT_S = 10.0  # default (system.node_silence_timeout): a beat that stood still this long is a node gone
SETTLED = (b"done", b"left", b"moved")  # a node's last beat: its workers finished, it left, it joined the next attempt
JOINED = b"in"  # a{k}/all: every node's join record is there
ABORTED = b"abort"  # a{k}/all: a node failed before the join completed (a{k}/abort says how)


def node_key(k: int, r: int) -> str:
    return f"a{k}/node{r}"


def nodes_key(k: int) -> str:
    return f"a{k}/nodes"


def beat_key(k: int, r: int) -> str:
    return f"a{k}/beat{r}"


def abort_key(k: int) -> str:
    return f"a{k}/abort"


def all_key(k: int) -> str:
    return f"a{k}/all"


def done_key(k: int, r: int) -> str:
    return f"a{k}/done{r}"


def verdict_key(k: int) -> str:
    return f"a{k}/verdict"


def enter(store: Any, k: int, r: int, record: bytes) -> None:
    """Node r's join record for attempt k, its beat key first: node 0's one read of every
    member's beat (a multi_get, which waits for missing keys) never waits for a node."""
    store.set(beat_key(k, r), b"0")
    store.set(node_key(k, r), record)


def publish(store: Any, k: int, cause: dict[str, Any]) -> bytes:
    """Offer a root cause for attempt k; returns the winner (first writer wins). A node still
    waiting in attempt k's join learns of it from `a{k}/all`."""
    winner = store.compare_set(abort_key(k), "", orjson.dumps(cause))
    store.compare_set(all_key(k), "", ABORTED)
    return winner


class OwnBeat:
    """This node's beat key for one attempt, from its join until it joins the next attempt
    ("moved"), its workers finish ("done") or it leaves ("left")."""

    def __init__(self, store: Any, node_rank: int) -> None:
        self.store, self.node_rank = store, node_rank  # node_rank: a spare node's changes when it takes a place
        self.attempt: int | None = None  # the attempt whose beat key this node sets
        self._count = 0
        self._sent = b"0"  # the value the key holds (enter() writes "0")

    def start(self, k: int, fresh: bool = True) -> None:
        """Beat for attempt k from now on; `fresh`: its key was just entered ("0")."""
        self.attempt = k
        if fresh:
            self._sent = b"0"

    def tick(self) -> None:
        """One request with an answer (compare_set: a plain set is never answered, so a partition
        would go unseen): the store watchdog sees node 0 gone when it stays unanswered. Not `add`:
        a foreign value in the key cannot break our connection; it is replaced at the next beat."""
        self._count += 1
        value = str(self._count).encode()
        got = self.store.compare_set(beat_key(self.attempt, self.node_rank), self._sent, value)
        self._sent = value if got == value else got

    def end(self, last: bytes, k: int | None = None) -> None:
        """The last beat (one of SETTLED), if it still beats (for attempt k, when given)."""
        if self.attempt is not None and (k is None or self.attempt == k):
            self.store.set(beat_key(self.attempt, self.node_rank), last)
            self.attempt = None


class BeatWatch:
    """Node 0's view of attempt k: when each other node's beat last moved, counted in node 0's
    own reads (`seq`), and the nodes found dead with the cause that names each."""

    def __init__(self, k: int, silent_s: float = SILENT_S) -> None:
        """`silent_s`: a beat that stood still this long is a node gone (system.node_silence_timeout)."""
        self.k, self.silent_s = k, silent_s
        self.seq = 0
        self._seen: dict[int, tuple[bytes, float, int]] = {}  # node -> (last value, when it changed, seq then)
        self.dead: dict[int, dict[str, Any]] = {}
        self._read_at: float | None = None  # when the latest read was made

    def observe(self, ranks: list[int], values: list[bytes], now: float) -> list[tuple[int, float]]:
        """One read of their beats; returns (node, seconds still) for each that stood still past silent_s.
        Values are compared as bytes, never parsed (a foreign value is just another value)."""
        self.seq += 1
        self._read_at = now
        silent = []
        for r, value in zip(ranks, values, strict=True):
            last = self._seen.get(r)
            if last is None or last[0] != value or value in SETTLED:
                self._seen[r] = (value, now, self.seq)
            elif now - last[1] > self.silent_s and r not in self.dead:
                silent.append((r, now - last[1]))
        return silent

    def pause(self, seconds: float) -> None:
        """Node 0 stood still this long (own_lag.py): it read no beat meanwhile, so that time is
        no node's silence; every beat's clock moves on by it."""
        if seconds > 0:
            self._seen = {r: (value, at + seconds, seq) for r, (value, at, seq) in self._seen.items()}

    def forget(self, r: int) -> None:
        """Node r's beat starts afresh (a spare node took its place): its silence is counted anew."""
        self._seen.pop(r, None)

    def settled(self, r: int) -> bool:
        last = self._seen.get(r)
        return last is not None and last[0] in SETTLED

    def verdict(self, members: Iterable[int]) -> dict[str, Any]:
        """The verdict after this read, for the round's `members` (verdict.py: its size does not
        grow with them)."""
        now = self._read_at
        late = {r for r, (_, at, _) in self._seen.items() if now is not None and now - at >= LATE_S}
        return summary(self.seq, {r: s for r, (_, _, s) in self._seen.items()}, self.dead, members, late)
