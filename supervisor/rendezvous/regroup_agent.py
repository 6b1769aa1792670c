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

import threading
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from supervisor.rendezvous.node_agent_main import Agent

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


def claim(agent: Agent, k: int, msg: dict[str, Any]) -> None:
    g = int(msg["generation"])
    mine = orjson.dumps(msg["claim"])
    winner = agent.store.compare_set(live_key(k, g), "", mine)
    agent.emit("regroup-claim", attempt=k, generation=g, won=winner == mine, claim=_claim_or_none(winner))


def watch(agent: Agent, k: int, msg: dict[str, Any]) -> None:
    if agent.connect is not None:  # a test's in-process store has no second connection: nothing to wait on
        threading.Thread(target=_follow, args=(agent, k), name=f"regroup-wait-{k}", daemon=True).start()


def _follow(agent: Agent, k: int) -> None:
    """Report round k's claims in order until the round is over (aborted, left, or a later join)."""
    try:
        conn = agent._connection()
    except RuntimeError:
        return  # the abort wait names a lost store
    g = 1
    try:
        while not (agent.lost or agent.leaving or k in agent._reported
                   or (agent.last_join is not None and agent.last_join > k)):
            if conn.wait([live_key(k, g)], WAIT_S):
                claimed = _claim_or_none(conn.get(live_key(k, g)))
                if claimed is not None and claimed.get("kind") == "node" and claimed.get("action") == "shrink":
                    agent.gone.add(claimed["node"])  # dead whole, the job went on without it: no `alive` waits for it
                agent.emit("regroup", attempt=k, generation=g, claim=claimed)
                g += 1
    except RuntimeError:
        return
    agent._spare.append(conn)  # a later round's wait reuses it


def _claim_or_none(raw: bytes) -> dict[str, Any] | None:
    """A claim as a node writes it; None for a value no gpuherd node writes (the store has no
    authentication): the supervisor then treats the group as taken and falls back."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if isinstance(value, dict) and isinstance(value.get("node"), int) and isinstance(value.get("rank"), int):
        return value
    return None
