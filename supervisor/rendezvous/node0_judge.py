"""Node 0's judgement of the other nodes of a round, and what every agent knows of those nodes.

`Nodes` is one agent's knowledge of its round (who is in, their hosts, who is found dead), shared
by the agent and, on node 0, its `Judge`. The judge alone reads every node's beat (one
`multi_get` a second, beat_watch.py), hears a node's direct connection close without a goodbye
(liveness.py), and decides what a dead node means: a spare node in its place
(spare_node_agent.py), the job shrunk without it (node_shrink_agent.py), or the job's root cause
for every node. It never names another node for node 0's own stall (own_lag.py). It is given the
store, the shared `Nodes` and three callables, never the agent.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from supervisor.rendezvous import agent_causes, node_move_out, node_shrink_agent, rank_claims, spare_node_agent
from supervisor.rendezvous.beat_watch import BEAT_S, SETTLED, BeatWatch, beat_key, publish, verdict_key
from supervisor.rendezvous.own_lag import OwnLag
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.store_calls import StoreCalls

CLOSED_GRACE_S = 5.0  # a node named dead by its closed connection: survivors stop their workers this long after
# node 0 ran again after a stall: connections that close this long after it are the stall's doing (the
# other nodes' watchdogs give node 0 up within a beat or two of SILENT_S without an answer)
STALL_MARGIN_S = 5.0


@dataclass
class Nodes:
    """What an agent knows of its round's nodes. Node 0's judge changes the dead-node sets and,
    when a spare node takes a place, that node's owner and host."""

    nnodes: int  # training nodes (--nnodes; MAX of an elastic job)
    members: list[int]  # the nodes in the round being run
    elastic: bool = False
    hosts: dict[int, str] = field(default_factory=dict)
    owners: dict[int, bytes] = field(default_factory=dict)  # node 0: each node's agent (rank_claims.owner_mark)
    gone: set[int] = field(default_factory=set)  # nodes found dead: nobody waits for them to leave
    lost_nodes: set[int] = field(default_factory=set)  # node 0: dead whole, the round went on without them
    promoted: dict[int, dict[int, int]] = field(default_factory=dict)  # node 0: round -> {dead node: spare node}
    spare_nodes: int = 0  # node 0: --spare-nodes (from its own join record)
    min_replicas: int = 0  # node 0: --min-replicas (from its own join record): a dead node may shrink the job

    def joined(self, members: list[int], records: list[dict[str, Any]]) -> None:
        """A round's join records (each checked already): its members, their hosts and agents."""
        self.hosts = {i: str(n.get("host", "?")) for i, n in zip(members, records, strict=True)}
        self.owners = {i: str(n.get("owner", "")).encode() for i, n in zip(members, records, strict=True)}
        self.members = members
        self.lost_nodes.clear()  # a restart's join waited for every node again

    def waited_for(self) -> list[int]:
        """The members still in the round: a node it went on without is never waited for."""
        return [i for i in self.members if i not in self.lost_nodes]

    def roster(self, k: int) -> Roster:
        """What the friend modules read of round k's nodes: a copy, never these sets."""
        return Roster(k, self.nnodes, self.spare_nodes, self.min_replicas, self.elastic, frozenset(self.gone),
                      dict(self.promoted.get(k, {})), dict(self.owners))


class Judge:
    """Node 0's side of the agent: the beats it reads, and every node it finds dead."""

    def __init__(self, nodes: Nodes, store: StoreCalls, silent_s: float,
                 report_abort: Callable[[int, bytes], None], connection: Callable[[], StoreCalls],
                 lost: Callable[[], bool]) -> None:
        """`report_abort(k, raw)`: attempt k's cause to this node's supervisor (once);
        `connection()`: a store connection of its own for the liveness thread; `lost()`: the
        agent lost the store (nothing is judged then)."""
        self.nodes, self.store, self.silent_s = nodes, store, silent_s
        self._report_abort, self._connection, self._lost = report_abort, connection, lost
        self.beats: BeatWatch | None = None  # the attempt whose beats it reads
        self.own_lag: OwnLag | None = None  # node 0's own stalls: never another node's death
        self._naming = threading.Lock()  # one dead node judged at a time (the loop, the liveness thread)
        self._liveness_store: StoreCalls | None = None  # the connection its liveness thread names nodes on
        self.moving_out: dict[int, str] = {}  # node told to leave as a straggler -> the verdict (node_move_out.py)

    def watch(self, k: int) -> None:
        """From now on attempt k's beats are read (from the join on: a node dying before its workers
        start is named too)."""
        if self.beats is None or self.beats.k != k:
            self.beats = BeatWatch(k, self.silent_s)

    def move_out(self, k: int, r: int, message: str, tell: Callable[[int, str], bool]) -> str | None:
        """Node 0's supervisor found node r a straggler in round k (`message`: its verdict): told to
        leave (`tell`, over its direct connection) where a spare node stands by to take its place;
        its connection's end is then named by the move. Returns why it was not (None: it was told)."""
        nodes, beats = self.nodes, self.beats
        if beats is None or beats.k != k:
            return f"round {k} is over"
        why = node_move_out.why_not(self.store, nodes.roster(k), r, nodes.members, nodes.lost_nodes | set(beats.dead))
        if why is not None:
            return why
        self.moving_out[r] = message
        if not tell(r, message):
            self.moving_out.pop(r, None)
            return f"node {r} has no direct connection to node 0's agent to be told"
        return None

    def verdict(self, k: int) -> dict[str, Any] | None:
        """Its own latest reading of attempt k's beats; None: it reads another attempt's, or none."""
        return self.beats.verdict(self.nodes.members) if self.beats is not None and self.beats.k == k else None

    def read_beats(self, now: float) -> None:
        """Every other member's beat in one request; one that stood still is named."""
        beats, nodes = self.beats, self.nodes
        others = [r for r in nodes.members if r != 0 and r not in nodes.lost_nodes]
        values = self.store.multi_get([beat_key(beats.k, r) for r in others])
        if self.own_lag is not None:  # node 0 did not read while it stood still: that time is nobody's silence
            beats.pause(self.own_lag.take_new())
        for r, still in beats.observe(others, values, now):
            self._declare(beats.k, r, self._silent(r, f"no heartbeat for {still:.0f} s"), self.store)
        self._publish_verdict(self.store)

    def _publish_verdict(self, store: StoreCalls) -> None:
        """Its latest reading of the beats, for an `alive` check on any node (verdict.py)."""
        store.set(verdict_key(self.beats.k), orjson.dumps(self.beats.verdict(self.nodes.members)))

    def connection_closed(self, r: int, mark: bytes | None) -> None:
        """Node r's connection ended without a goodbye: its agent (`mark`, its claim on the rank)
        died with its processes. It is dead in the verdict and published as every node's root
        cause at once (named on every survivor within one fan-out), and its rank is free for the
        node started again in its place. The cause carries `stop_after_s` (CLOSED_GRACE_S): each
        survivor's supervisor stops its workers only that long after, so that its workers, failing
        on the same closed connections at their next collective, fail first and are recorded as
        the dead node's consequence, not cut short by the stop."""
        nodes = self.nodes
        try:
            if self._liveness_store is None:
                self._liveness_store = self._connection()
            conn = self._liveness_store
            beats = self.beats  # a spare node given node r's place: node r died
            r = spare_node_agent.promoted_as(nodes.promoted.get(beats.k, {}) if beats is not None else {}, r)
            if r >= nodes.nnodes or beats is None or r not in nodes.members or r in beats.dead \
                    or r in nodes.lost_nodes or self._lost():
                nodes.gone.update([r] if r >= nodes.nnodes else [])  # a spare node standing by: no longer one
                rank_claims.release(conn, r, mark)  # between attempts: the next join names it
                return
            if conn.get_if_set(beat_key(beats.k, r)) in SETTLED:
                rank_claims.release(conn, r, mark)
                return
            stall, moved = self._own_stall(), self.moving_out.pop(r, None)
            if moved is not None:  # it left as told: a straggler moved out, not a death
                cause = {**node_move_out.cause(r, nodes.hosts.get(r, "?"), moved), "stop_after_s": CLOSED_GRACE_S}
            elif stall is not None:
                cause = agent_causes.stalled(nodes.hosts.get(0, "?"), r, stall, self.silent_s)
            else:
                cause = {**self._silent(r, "its connection to node 0 closed without a goodbye"),
                         "stop_after_s": CLOSED_GRACE_S}
            self._declare(beats.k, r, cause, conn)
        except RuntimeError as exc:
            short = " ".join(str(exc).split("Exception raised from")[0].split())[:200]
            print(f"node agent: could not name node {r}: {short}", file=sys.stderr, flush=True)

    def _own_stall(self) -> float | None:
        """How long node 0 stood still lately, where that was long enough for every other node's
        store watchdog to give it up (silent_s unanswered); None: no such stall."""
        if self.own_lag is None:
            return None
        self.own_lag.tick()  # a stall still unseen by the ticker (this thread ran first) counts too
        stall = self.own_lag.stalled_within(STALL_MARGIN_S)
        return stall if stall is not None and stall >= self.silent_s - BEAT_S else None

    def _silent(self, r: int, why: str) -> dict[str, Any]:
        return agent_causes.silent(r, self.nodes.hosts.get(r, "?"), why)

    def _declare(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> None:
        """Node r is dead; its cause goes to every node (the abort, unless a failure came first),
        unless a spare node takes its place or the job goes on without it."""
        nodes = self.nodes
        owner = nodes.owners.get(r)
        if self._go_on_without(k, r, cause, store):
            if r in nodes.lost_nodes:  # the job went on without it: node r started again may take its rank
                rank_claims.release(store, r, owner)
            return
        rank_claims.release(store, r, owner)  # node r started again takes its rank back
        if self.beats is not None and self.beats.k == k:
            self.beats.dead[r] = cause
            self._publish_verdict(store)  # named dead before the abort is read
        nodes.gone.add(r)
        self._report_abort(k, publish(store, k, cause))

    def _go_on_without(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> bool:
        """True when round k goes on without dead node r: a spare node takes its place, else, with
        --min-replicas, the job shrinks."""
        with self._naming:
            if r in self.nodes.lost_nodes:
                return True  # judged already (its silence and its closed connection both name it)
            return self._spare_node_takes(k, r, cause, store) or self._shrink_without(k, r, cause, store)

    def _spare_node_takes(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> bool:
        """A spare node standing by takes dead node r's place: from now on it is node r here (its
        claim, its host; its beat not yet due), then it is told so."""
        nodes = self.nodes
        took = spare_node_agent.take_over(store, nodes.roster(k), r, cause["message"],
                                          node_move_out.CLAIM_KIND if cause.get("moved_out") else "node")
        nodes.gone.update(took.passed_over)  # frozen spare nodes: never chosen again
        hand = took.handover
        if hand is None:
            return False
        nodes.owners[r] = hand.mark
        nodes.promoted.setdefault(k, {})[r] = hand.spare
        nodes.hosts[r] = hand.host
        if self.beats is not None and self.beats.k == k:
            self.beats.dead.pop(r, None)
            self.beats.forget(r)
        nodes.gone.discard(r)
        spare_node_agent.promote(store, k, hand)
        return True

    def _shrink_without(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> bool:
        """No spare node free: with --min-replicas the job goes on without dead node r, waiting for
        it no more; else `cause` says why not, where the floor is why."""
        shrink = node_shrink_agent.shrink_over(store, self.nodes.roster(k), r, cause["message"])
        cause["message"] += shrink.why_not
        if not shrink.claimed:
            return False
        self.nodes.lost_nodes.add(r)
        self.nodes.gone.add(r)
        if self.beats is not None and self.beats.k == k:
            self.beats.forget(r)
        return True
