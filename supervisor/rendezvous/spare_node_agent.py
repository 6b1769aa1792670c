"""Spare nodes (--spare-nodes K), inside the node agent: a node that stands by in the job's
round without a rank, and node 0 handing it the ranks of a node that died whole.

A spare node has a --node-rank of N or more (N: the training nodes, --nnodes). It never writes
a join record (the round's join waits for nodes 0..N-1 only); per round k it reads the round's
records once the join is decided (`a{k}/all`), checks its settings against node 0's (another
model, mode or --run-id: it is refused alone, exit 2, the job goes on without it; a value no
gpuherd node writes, in the records or its promotion, is named and ends it alone, exit 1), connects to
node 0's agent (`hello s`: a spare node that dies is seen, and just left out), writes

    a{k}/spare{s}     its record (host, nproc, owner: its claim on rank s): it stands by in round k

and waits, on a connection of its own, for the first of

    a{k}/ping{s}      node 0 is about to choose it: it answers at once, `a{k}/pong{s}` "alive"
                      (compare_set: node 0 writes "passed over" there first when no answer came
                      within PING_S; a spare node that wakes to that ends itself, one line)
    a{k}/promote{s}   node 0 hands it a dead node's place: {node, generation, claim}
    a{k}/abort        the round ended (a restart): it stands by in round k+1
    closed            the job ended: it leaves (exit 0, nothing of it ran)

Node 0, when a training node r dies whole (its direct connection closed, or its beat stood
still), looks for a spare node standing by in the round with r's number of workers and not
dead, and checks it is alive (the ping: a frozen one, SIGSTOPped or swapped out, is passed over and
never chosen again). With one, instead of publishing r's death as the round's abort, it claims the rebuilt
group (`a{k}/live{g}`, g the round's first unclaimed generation, first claim wins: a node that
lost a rank in the same instant took it, and the death is published as before), naming the
dead node, its ranks and the spare node, then writes `a{k}/promote{s}`. The survivors'
supervisors hear the claim as any other node's live recovery (regroup_agent.py); their
workers rebuild the group with the spare node's, which join generation g. From then on the
spare node is node r for the rest of the job: its agent beats, finishes (`done`), reports
(`outcome`) and leaves (`left`) as node r, owns `rank{r}/owner` (node 0 hands it over from the
dead owner: a restart's join as node r is its; its own rank s is freed), and its direct
connection says `hello r` (its death is node r's again, even before it said so).
Node 0 itself cannot be replaced (it hosts the job store and the workers' store).

The agent (node_agent_main.py) hands this module what it needs, never itself: a spare node's
`SpareNode` (who it is, how it speaks), node 0's `Roster` (roster.py); what is decided comes
back as a value the agent applies to its own state: a `Promotion` (the spare node becomes node
r), a `Takeover` (node 0 counts the spare node as node r, then `promote` tells it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from supervisor.rendezvous.beat_watch import JOINED, abort_key, all_key, nodes_key
from supervisor.rendezvous.elastic_rounds import CLOSED_KEY
from supervisor.rendezvous.nodes import node_ranks, settings_problem
from supervisor.rendezvous import rank_claims
from supervisor.rendezvous.agent_causes import malformed
from supervisor.rendezvous.regroup_agent import claim_next
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.store_calls import json_or_none

POLL_S = 1.0  # a wait's piece: a round's end or the job's is seen within it (4 requests a second per spare node)
PING_S = 3.0  # node 0 waits this long for a spare node's answer before it passes it over
ALIVE, PASSED_OVER = b"alive", b"passed over"


def spare_key(k: int, s: int) -> str:
    return f"a{k}/spare{s}"


def promote_key(k: int, s: int) -> str:
    return f"a{k}/promote{s}"


def ping_key(k: int, s: int) -> str:
    return f"a{k}/ping{s}"


def pong_key(k: int, s: int) -> str:
    return f"a{k}/pong{s}"


@dataclass(frozen=True)
class SpareNode:
    """What a spare node's agent hands `stand_by`: who it is, and how it speaks (never itself)."""
    s: int  # its --node-rank (N or more)
    mark: bytes  # its claim on rank s (rank_claims.owner_mark)
    where: str  # the job store's host:port, for a line naming a foreign value
    emit: Callable[..., None]  # an event to its supervisor
    link: Callable[[str | None], None]  # connect to node 0's agent ("host:port"), once (liveness.py)


@dataclass(frozen=True)
class Promotion:
    """Node 0 handed this spare node dead node `node`'s place in round k: the agent becomes node `node`."""
    k: int
    node: int
    generation: int  # the rebuilt group its workers join
    claim: dict[str, Any]
    nodes: list[dict[str, Any]]  # round k's join records


def stand_by(conn: Any, me: SpareNode, k: int, record: dict[str, Any]) -> Promotion | None:
    """The spare node's side, from round k on (`record`: its own join record): per round, stand by
    until node 0 promotes it (returned: the agent takes the place), the job ends or it is refused
    (said with `me.emit`; None)."""
    s = me.s
    while True:
        got = _first(conn, [all_key(k), CLOSED_KEY])
        if got == CLOSED_KEY:
            me.emit("spare-closed", attempt=k)
            return None
        if conn.get(all_key(k)) != JOINED:  # the round failed before it ran: the next one
            k += 1
            continue
        raw = conn.get(nodes_key(k))
        nodes = json_or_none(raw)
        if not (isinstance(nodes, list) and nodes and all(isinstance(n, dict) for n in nodes)):
            cause = malformed(me.where, nodes_key(k), raw, "every node's join record (a JSON list)")
            me.emit("spare-refused", attempt=k, message=cause["message"], exit_code=cause["exit_code"])
            return None
        problem = settings_problem(record, nodes[0], s)
        if problem is not None:
            me.emit("spare-refused", attempt=k, message=f"{problem}: this spare node does not stand by for the job",
                    exit_code=2)
            return None
        me.link(nodes[0].get("liveness"))
        conn.set(spare_key(k, s), orjson.dumps({"host": record.get("host"), "nproc": record["nproc"],
                                                "owner": me.mark.decode()}))
        me.emit("standing-by", attempt=k, nodes=nodes)
        got = _first(conn, [ping_key(k, s), promote_key(k, s), abort_key(k), CLOSED_KEY])
        if got == ping_key(k, s):
            if not _answer_ping(conn, me, k):
                return None
            got = _first(conn, [promote_key(k, s), abort_key(k), CLOSED_KEY])
        if got == CLOSED_KEY:
            me.emit("spare-closed", attempt=k)
            return None
        if got == abort_key(k):
            k += 1
            continue
        return _promotion(conn, me, k, nodes)


def _answer_ping(conn: Any, me: SpareNode, k: int) -> bool:
    """Node 0 checks this spare node is alive before it promotes it: answer, unless node 0 already
    gave up on the answer (this node was frozen meanwhile), which is said (False: stand by no more)."""
    s = me.s
    if conn.compare_set(pong_key(k, s), "", ALIVE) == ALIVE:
        return True
    me.emit("spare-passed-over", attempt=k,
            message=f"spare node {s}: node 0 needed it in round {k} and it did not answer within "
                    f"{PING_S:g} s (this node was frozen: stopped, swapped out or starved); node 0 "
                    "passed it over and no longer counts on it, so it stops standing by (nothing of "
                    "it ran)")
    return False


def _promotion(conn: Any, me: SpareNode, k: int, nodes: list[dict[str, Any]]) -> Promotion | None:
    """Node 0's promotion of this spare node in round k, decoded; None (refused, said) if unreadable."""
    key = promote_key(k, me.s)
    raw = conn.get(key)
    promotion = json_or_none(raw)
    if not (isinstance(promotion, dict) and isinstance(promotion.get("node"), int)
            and isinstance(promotion.get("generation"), int) and isinstance(promotion.get("claim"), dict)):
        cause = malformed(me.where, key, raw, "node 0's promotion of this spare node")
        me.emit("spare-refused", attempt=k, message=cause["message"], exit_code=cause["exit_code"])
        return None
    return Promotion(k, int(promotion["node"]), int(promotion["generation"]), promotion["claim"], nodes)


def _first(conn: Any, keys: list[str]) -> str:
    """The first of `keys` set on the store: a server-side wait on the one that matters most
    (the first: it answers the moment it is set), the others checked once a second."""
    while True:
        for key in keys:
            if conn.check([key]):
                return key
        conn.wait(keys[:1], POLL_S)


@dataclass(frozen=True)
class Handover:
    """Node 0 gives dead node `node`'s place to spare node `spare` (its host, its claim `mark`), in
    rebuilt group `generation` (`claim`: what every node hears)."""
    node: int
    spare: int
    host: str
    mark: bytes
    generation: int
    claim: dict[str, Any]


@dataclass(frozen=True)
class Takeover:
    """Node 0's look for a spare node: the one handed the place (None: no spare node takes it, the
    death goes on as before), and the spare nodes it found frozen (dead to it from now on)."""
    handover: Handover | None
    passed_over: tuple[int, ...] = ()


def take_over(store: Any, roster: Roster, r: int, failed: str, kind: str = "node") -> Takeover:
    """Node 0: node r died whole in round `roster.k` (`failed`: its cause's message; `kind`: the
    claim's, "node", or node_move_out.py's for a straggler node told to leave); a spare node
    that takes its place is claimed and named in the result (the death is then a live recovery,
    not the round's abort). Node 0 applies it, then tells the spare node (`promote`)."""
    k = roster.k
    if roster.spare_nodes <= 0 or r == 0 or r in roster.promoted:
        return Takeover(None)
    nodes = round_records(store, k)
    if nodes is None or r >= len(nodes):
        return Takeover(None)  # the round's records are not there (it died in the join): the restart as before
    spare, passed_over = _live_spare(store, roster, nodes[r].get("nproc"))
    if spare is None:
        return Takeover(None, passed_over)
    s, host, mark = spare
    ranks = node_ranks(nodes, r)
    claim = {"node": r, "rank": ranks[0], "ranks": ranks, "device": f"node {r}", "failed": failed, "kind": kind,
             "lost_pid": 0, "replaced_by_pid": 0, "died_at": time.time(), "spare_node": s, "spare_host": host,
             # what survivors that wait for a decision (--min-replicas) read: node 0 writes it into
             # the workers' store when it hears this claim, as for any node's spare promotion
             "decision": {"spare": ranks[0]}}
    if not rank_claims.transfer(store, r, roster.owners.get(r), mark):
        return Takeover(None, passed_over)  # node r, started again, took its rank back already: the restart is its
    g = claim_next(store, k, claim)
    if g is None:  # a node lost a rank in the same instant: two losses at once, the death is published
        rank_claims.release(store, r, mark)  # and node r's rank is free for the node started again
        return Takeover(None, passed_over)
    rank_claims.release(store, s, mark)  # a spare node started with --node-rank s stands by again
    return Takeover(Handover(r, s, host, mark, g, claim), passed_over)


def promote(store: Any, k: int, hand: Handover) -> None:
    """Node 0, once it counts spare node `hand.spare` as node `hand.node`: the spare node becomes it."""
    store.set(promote_key(k, hand.spare), orjson.dumps({"node": hand.node, "generation": hand.generation,
                                                        "claim": hand.claim}))


def round_records(store: Any, k: int) -> list[dict[str, Any]] | None:
    """Round k's join records, every training node's (None: the round's join was not decided)."""
    nodes = json_or_none(store.get_if_set(nodes_key(k)))
    return nodes if isinstance(nodes, list) and all(isinstance(n, dict) for n in nodes) else None


def _live_spare(store: Any, roster: Roster, nproc: Any) -> tuple[tuple[int, str, bytes] | None, tuple[int, ...]]:
    """The lowest spare node standing by in the round with `nproc` workers, not dead, not promoted,
    that answers node 0's ping within PING_S (one that does not is passed over for good):
    (its node rank, its host, its claim), and the spare nodes passed over on the way."""
    k, passed_over = roster.k, []
    for s, record in standing_with(store, roster, nproc):
        mark = str(record.get("owner", "")).encode()
        store.set(ping_key(k, s), b"1")
        store.wait([pong_key(k, s)], PING_S)
        if store.compare_set(pong_key(k, s), "", PASSED_OVER) == ALIVE:
            return (s, str(record.get("host", "?")), mark), tuple(passed_over)
        passed_over.append(s)  # frozen: never chosen; when it wakes it reads "passed over" and ends itself
        rank_claims.release(store, s, mark)
    return None, tuple(passed_over)


def standing_with(store: Any, roster: Roster, nproc: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    """The spare nodes standing by in round `roster.k` with `nproc` workers, neither found dead nor
    promoted, lowest first: (its node rank, its record), each read as it is reached."""
    for s in roster.spares_free():
        record = json_or_none(store.get_if_set(spare_key(roster.k, s)))
        if isinstance(record, dict) and record.get("nproc") == nproc:
            yield s, record


def promoted_as(promoted: Mapping[int, int], s: int) -> int:
    """Node 0: the training node whose place spare node s took in the round running (`promoted`:
    that round's dead node -> spare node; its death is that node's, even before its direct
    connection said so); `s` when it took none."""
    return next((r for r, spare in promoted.items() if spare == s), s)


def standing(store: Any, roster: Roster) -> list[int]:
    """Node 0 at the job's end: the spare nodes that stood by in round `roster.k` and were not promoted."""
    return [s for s in roster.spares_free() if store.check([spare_key(roster.k, s)])]

