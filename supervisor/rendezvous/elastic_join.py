"""The node agent's side of an elastic job's rounds (--nnodes MIN:MAX, elastic_rounds.py): a node
joining the next round, and node 0 admitting a node that waits for one. Given the store, the
rounds and the agent's `emit`, never the agent: the round joined comes back for it to take."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from supervisor.rendezvous import agent_causes
from supervisor.rendezvous.beat_watch import abort_key, node_key
from supervisor.rendezvous.elastic_rounds import ElasticRounds, refused_key
from supervisor.rendezvous.nodes import settings_problem
from supervisor.rendezvous.store_calls import StoreCalls


def join(store: StoreCalls, rounds: ElasticRounds, record: bytes, timeout: float, where: str,
         emit: Callable[..., None]) -> tuple[int, list[int] | None] | None:
    """Join the next round (node 0 decides who is in): (the round, its members), the members None
    when it aborted before it ran (its abort key says why); None when this node's join ended
    here (said with `emit`: no round in `timeout`, the job closed, or this node refused)."""
    aborted = lambda k: store.check([abort_key(k)])  # noqa: E731 - a node failed before joining
    say_waiting = lambda k, members: emit("waiting", attempt=k, round=k, members=members)  # noqa: E731
    if rounds.node_rank == 0:
        k, members = rounds.open_and_close(record, aborted)
        if members is None and not aborted(k):  # fewer than MIN in time: every waiting node reads why
            too_few = rounds.too_few(k, lambda r: _record_host(store, k, r), where)
            store.compare_set(abort_key(k), "", orjson.dumps(too_few))
        return k, members
    target = rounds.wait_round(timeout)
    if target is None:
        emit("join-timeout", attempt=0, missing=[0], timeout=timeout)
        return None
    k, late = target
    if late:  # round k-1 runs without this node
        say_waiting(k - 1, rounds.members_of(k - 1) or [])
    k, members, why = rounds.admitted(k, record, aborted, say_waiting)
    if why == "closed":
        emit("join-closed", attempt=k)
        return None
    if why == "refused":  # node 0 found this node's settings differ from the job's
        key = refused_key(rounds.node_rank)
        emit("abort", attempt=k, cause=agent_causes.read(where, key, store.get(key)))
        emit("join-aborted", attempt=k)
        return None
    return k, members


def admit_waiting(store: StoreCalls, rounds: ElasticRounds, k: int) -> None:
    """Node 0 of an elastic job, while round k runs: a node waiting for the next round restarts
    every node's workers so it joins (torchrun's num_nodes_waiting > 0)."""
    waiting = [r for r in rounds.waiting(k) if _settings_agree(store, rounds, k, r)]
    if waiting:
        who = ", ".join(f"node {r} ({_record_host(store, k + 1, r)})" for r in waiting)
        store.compare_set(abort_key(k), "", orjson.dumps(agent_causes.admitting(who)))


def _settings_agree(store: StoreCalls, rounds: ElasticRounds, k: int, r: int) -> bool:
    """Node 0: a waiting node with another --run-id, model or mode would take the healthy job
    down at its admission (every node exits 2 then): it is refused alone, before that."""
    mine, theirs = (_json_or_none(store.get(key)) for key in (node_key(k, 0), node_key(k + 1, r)))
    if not (isinstance(mine, dict) and isinstance(theirs, dict)):
        return True  # a malformed record is named at the join itself
    problem = settings_problem(theirs, mine, r)
    if problem is None:
        return True
    rounds.refuse(k, r, orjson.dumps(agent_causes.not_admitted(r, theirs.get("host"), problem)))
    return False


def _record_host(store: StoreCalls, k: int, r: int) -> str:
    record = _json_or_none(store.get(node_key(k, r)))
    return str(record.get("host", "?")) if isinstance(record, dict) else "?"


def _json_or_none(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
