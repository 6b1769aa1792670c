"""An `alive` check, on any node after a failure: which other nodes of the round are dead, as
node 0's reading of the beats says (its verdict, beat_watch.py). A worker's "connection closed by
peer" is then a dead node's consequence, not the job's cause. Node 0 answers from its own
reading, the others from the verdict node 0 publishes on the store (verdict.py: a few dozen
bytes, plus the nodes it names, however many nodes there are), read at the start and then
once a second."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from supervisor.rendezvous import agent_causes
from supervisor.rendezvous.beat_watch import verdict_key
from supervisor.rendezvous.node0_judge import Judge, Nodes
from supervisor.rendezvous.store_calls import StoreCalls
from supervisor.rendezvous.verdict import parse_verdict, undecided


class AliveCheck:
    def __init__(self, store: StoreCalls, nodes: Nodes, judge: Judge, silent_s: float, where: str,
                 emit: Callable[..., None]) -> None:
        self.store, self.nodes, self.judge, self.silent_s, self.where = store, nodes, judge, silent_s, where
        self.emit = emit
        self.pending: tuple[int, float, int] | None = None  # (attempt, began, node 0's verdict seq then)
        self._set = False  # this check read node 0's verdict once: the key stays set, a `get` is one request
        self._read: dict[str, Any] | None = None  # the verdict read at the start, for the first poll

    def begin(self, k: int, now: float) -> None:
        """Node 0's seq now (its own reading on node 0, else a read of the store, which the first
        poll, at once after an `alive` command, decides from: one read fewer per check)."""
        self._set = False
        own = self.judge.verdict(k)
        self._read = None if own is not None else self._stored(k)
        first = own if own is not None else self._read
        self.pending = (k, now, first["seq"] if first is not None else 0)

    def poll(self, now: float, node_rank: int) -> None:
        """Done once node 0's reading proves each node alive since the check began or names it dead;
        undecided ones are waited for at most silent_s + 2 s (then counted alive)."""
        k, began, seq0 = self.pending
        verdict = self._read if self._read is not None else self._verdict(k)
        self._read = None
        if verdict is None:
            self.pending = None
            raw = self.store.get(verdict_key(k))
            self.emit("alive", attempt=k, silent=[agent_causes.malformed(self.where, verdict_key(k), raw,
                                                                         "node 0's reading of the heartbeats")])
            return
        ranks = [r for r in self.nodes.members if r not in (0, node_rank) and r not in self.nodes.gone]
        silent = [c for c in verdict["dead"] if c["node"] != node_rank]
        if not silent and undecided(verdict, seq0, ranks) and now - began < self.silent_s + 2:
            return  # a node named dead answers at once: the first one is the cause, whoever else is alive
        self.pending = None
        self.nodes.gone.update(c["node"] for c in silent)
        self.emit("alive", attempt=k, silent=silent)

    def _verdict(self, k: int) -> dict[str, Any] | None:
        """Node 0's latest reading of attempt k's beats (its own, on node 0); None: a foreign value."""
        if (own := self.judge.verdict(k)) is not None:
            return own
        return self._stored(k)

    def _stored(self, k: int) -> dict[str, Any] | None:
        """The verdict node 0 published on the store; None: a foreign value."""
        raw = self.store.get(verdict_key(k)) if self._set else self.store.get_if_set(verdict_key(k))
        self._set = raw is not None
        return parse_verdict(raw)
