"""A multi-node live recovery's control plane, inside the node agent: which rebuilt group a
lost rank's node forms, and every other node told of it.

Keys, per attempt (round) k:

    a{k}/live{g}   the claim of rebuilt group g (the job's g-th live recovery in round k): the
                   node that lost a rank and promotes its own warm spare writes it with
                   compare_set (first writer wins): {node, rank, device, lost_pid,
                   replaced_by_pid, died_at (wall clock), failed, action, decision}. A node whose
                   claim loses (two ranks lost at once on two nodes) does not recover live: it
                   falls back to the job-wide restart. With --min-replicas a node with no spare
                   left claims a shrink the same way, and its refilled spare's regrow (`action`;
                   `decision`: what node 0's supervisor writes into the workers' store it hosts).

Every node's agent waits for a{k}/live{g}, g = 1, 2, ... in a thread with a connection of its
own (a server-side wait, as for the abort: no request while nothing happens) and reports
each claim, its own node's too, so every supervisor knows which rank is being replaced, by
which pid, in which generation, and counts it against --max-restarts alike. Which survivor
sends the state needs no key: every rank of the rebuilt group learns every rank's completed
steps in its first collective, and the same rule picks the same source on every rank.

Commands (the agent's dispatch table):

    {"cmd": "regroup-claim", "attempt": k, "generation": g, "claim": {...}}
        -> regroup-claim {attempt, generation, won, claim: the winner}
    {"cmd": "regroup-watch", "attempt": k}
        -> regroup {attempt, generation, claim} for every claim of round k, in order
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson

from supervisor.rendezvous.agent_messages import ClaimRegroup
from supervisor.rendezvous.live_claim import decode_claim
from supervisor.rendezvous.store_calls import StoreCalls

# One server-side wait for the next claim, as long as the abort wait's (2 requests per 30 s while
# nothing happens); between two, the thread checks that the round is still on.
WAIT_S = 30.0


def live_key(k: int, g: int) -> str:
    return f"a{k}/live{g}"


def claim_next(store: Any, k: int, claim: dict[str, Any]) -> int | None:
    """Node 0 claims round k's first unclaimed rebuilt group for a node that died whole (a spare
    node takes it, or the job shrinks); the generation claimed, or None: a node that lost a rank
    in the same instant took it (two losses at once: the death is published as the abort)."""
    g = 1
    while store.check([live_key(k, g)]):
        g += 1
    mine = orjson.dumps(claim)
    return g if store.compare_set(live_key(k, g), "", mine) == mine else None


def claims(store: Any, k: int) -> list[dict[str, Any] | None]:
    """Round k's claims so far, in order (None: a value no gpuherd node writes)."""
    found: list[dict[str, Any] | None] = []
    while (raw := store.get_if_set(live_key(k, len(found) + 1))) is not None:
        found.append(_claim_or_none(raw))
    return found


def claim(store: Any, emit: Callable[..., None], cmd: ClaimRegroup) -> None:
    """The agent's `regroup-claim`: this node's claim of rebuilt group g, answered with the winner."""
    k, g = cmd.attempt, cmd.generation
    mine = orjson.dumps(cmd.claim)
    winner = store.compare_set(live_key(k, g), "", mine)
    emit("regroup-claim", attempt=k, generation=g, won=winner == mine, claim=_claim_or_none(winner))


def follow(take: Callable[[], StoreCalls], give_back: Callable[[StoreCalls], None], k: int,
           over: Callable[[], bool]) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """Round k's claims in order, (generation, claim), until `over()` (the round aborted, left, or a
    later join), on a connection of its own (`take`; given back for a later round's wait when the
    round is over). A lost store ends it quietly: the abort wait names that."""
    try:
        conn = take()
    except RuntimeError:
        return
    g = 1
    try:
        while not over():
            if conn.wait([live_key(k, g)], WAIT_S):
                yield g, _claim_or_none(conn.get(live_key(k, g)))
                g += 1
    except RuntimeError:
        return
    give_back(conn)


def lost_whole(claimed: dict[str, Any] | None) -> list[int]:
    """The node a claim says died whole and the job went on without (a shrink node 0 claimed for it,
    node_shrink_agent.py): no `alive` check waits for it. Empty for any other claim."""
    claim = decode_claim(claimed)
    return [claim.node] if claim is not None and claim.kind == "node" and claim.action == "shrink" else []


def _claim_or_none(raw: bytes) -> dict[str, Any] | None:
    """A claim as a node writes it; None for a value no gpuherd node writes (the store has no
    authentication): the supervisor then treats the group as taken and falls back."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if decode_claim(value) is not None:
        return value
    return None
