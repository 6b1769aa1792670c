"""How an attempt and the job end on the job store, node 0's agent's side: the wait for every
member's workers to finish, every other node's outcome for the one summary, and the store kept
up until each node that joined has left. Given the facts (the store, the nodes, a Roster), never
the agent: what they find comes back for the agent to emit."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from typing import Any

from supervisor.rendezvous import spare_node_agent
from supervisor.rendezvous.beat_watch import BEAT_S, abort_key, done_key, node_key
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.store_calls import StoreCalls, json_or_none


def wait_done(store: StoreCalls, k: int, members: list[int], timeout: float) -> tuple[bytes | None, list[int]]:
    """Until every one of `members` finished attempt k, the abort, or `timeout` s: (the abort's value
    on the store when it came first, else None; the members not done when the time ran out)."""
    keys = [done_key(k, i) for i in members]
    deadline = time.monotonic() + timeout
    while not store.wait(keys, max(0.0, min(BEAT_S, deadline - time.monotonic()))):
        raw = store.get_if_set(abort_key(k))
        if raw is not None:
            return raw, []
        if time.monotonic() >= deadline:
            return None, [members[i] for i in store.missing(keys)]
    return None, []


def outcomes(store: StoreCalls, others: list[int], gone: Collection[int], lost_nodes: Collection[int],
             hosts: Mapping[int, str], timeout: float) -> list[dict[str, Any] | None]:
    """Each of `others`' outcome (a node found dead, `gone`, is not waited for; one the job went on
    without, `lost_nodes`, is said lost when it wrote none); None where none came or it is foreign."""
    store.wait([f"outcome{i}" for i in others if i not in gone], timeout)
    keys = [f"outcome{i}" for i in others]
    absent = set(store.missing(keys))
    present = [key for i, key in enumerate(keys) if i not in absent]
    found = dict(zip(present, store.multi_get(present), strict=True))
    said = [json_or_none(found[key]) if key in found else None for key in keys]
    for i, r in enumerate(others):
        if r in lost_nodes and said[i] is None:
            said[i] = {"node": r, "outcome": f"lost ({hosts.get(r, '?')}): it died whole and the job went on "
                                             "without its ranks (--min-replicas)"}
    return [o if isinstance(o, dict) else None for o in said]


def linger(store: StoreCalls, roster: Roster, timeout: float) -> list[int]:
    """The store stays up until every node that joined round `roster.k` (its last) has left, and
    every spare node still standing by (told the job closed): the ones that did not in `timeout` s."""
    candidates = [i for i in range(1, roster.nnodes) if i not in roster.gone]
    absent = set(store.missing([node_key(roster.k, i) for i in candidates]))
    joined = [r for i, r in enumerate(candidates) if i not in absent]
    store.set(spare_node_agent.CLOSED_KEY, b"1")  # a spare node standing by leaves too
    joined += spare_node_agent.standing(store, roster)
    left = [f"left{i}" for i in joined]
    store.wait(left, timeout)
    return [joined[i] for i in store.missing(left)]
