"""A fixed-size job's join of round k on the job store (--nnodes N), the node agent's side: this
node's record entered, node 0 gathering every record into one value once all are in, and the
wait for the join's decision. Given the store and the facts, never the agent: what the join came
to comes back (`Joined`) for the agent to take.

Only node 0 asks about all N record keys (a server-side wait, in pieces): were each node to ask
whether its record came last (a `check` of N keys each), the store would parse N x N keys per
join, about 220 s of its one thread at 16,384 nodes. Every other node waits on one key."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from supervisor.rendezvous import agent_causes
from supervisor.rendezvous.beat_watch import ABORTED, JOINED, abort_key, all_key, enter, node_key, nodes_key, publish
from supervisor.rendezvous.store_calls import StoreCalls, json_or_none

WAIT_SLICE_S = 5.0  # a long server-side wait is asked in pieces this long: the watchdog sees a partition in it
GATHER_SLICE_S = 1.0  # node 0's wait for every record, in pieces: between them it sees a node's abort


@dataclass(frozen=True)
class Joined:
    """Round k's join: `missing` (no decision in time: the nodes whose record never came), else
    `abort` (a node failed before it completed: the cause's value), else every node's record as
    read from `nodes_raw` (an entry that is no record is the agent's to name)."""
    missing: list[int] | None = None
    abort: bytes | None = None
    records: list[Any] | None = None
    nodes_raw: bytes = b""


def join(store: StoreCalls, k: int, r: int, nnodes: int, record: bytes, timeout: float, where: str) -> Joined:
    keys = [node_key(k, i) for i in range(nnodes)]
    enter(store, k, r, record)
    if r == 0:  # node 0 gathers them all, and everyone waiting goes on
        if _all_in(store, k, keys, timeout):
            _gather(store, k, keys, where)
        elif not store.check([all_key(k)]):
            return Joined(missing=store.missing(keys))
    if not store.wait_long([all_key(k)], timeout, WAIT_SLICE_S):
        return Joined(missing=store.missing(keys))
    decided = store.get(all_key(k))
    if decided == JOINED:
        raw = store.get(nodes_key(k))
        records = json_or_none(raw)
        if not (isinstance(records, list) and len(records) == nnodes):
            records = [None] * nnodes
        return Joined(records=records, nodes_raw=raw)
    if (cause := store.get_if_set(abort_key(k))) is not None:  # a node failed before the join completed
        return Joined(abort=cause)
    malformed = agent_causes.malformed(where, all_key(k), decided, f'"{JOINED.decode()}" or "{ABORTED.decode()}"')
    return Joined(abort=publish(store, k, malformed))


def _all_in(store: StoreCalls, k: int, keys: list[str], timeout: float) -> bool:
    """Node 0: True once every node's record is in; False when the round was decided meanwhile (a
    node's abort) or `timeout` passed. The store answers the wait when the last record is set."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if store.wait(keys, min(left, GATHER_SLICE_S)):
            return True
        if store.check([all_key(k)]):
            return False
    return False


def _gather(store: StoreCalls, k: int, keys: list[str], where: str) -> None:
    """Node 0, once every record is in, reads them all (one request) and writes them as one
    value: every node then reads one key, where each reading all N records would make the
    store serve N x N records (200 MB at 1,024 nodes, all of it on node 0's one store thread).
    A record no gpuherd node writes is named here, with its key, as the job's cause."""
    raws = store.multi_get(keys)
    records = [json_or_none(raw) for raw in raws]
    for i, (key, raw, record) in enumerate(zip(keys, raws, records, strict=True)):
        if not is_record(record):
            publish(store, k, agent_causes.malformed(where, key, raw, f"node {i}'s join record (host, nproc, settings)"))
            return
    store.compare_set(nodes_key(k), "", orjson.dumps(records))
    store.compare_set(all_key(k), "", JOINED)


def is_record(record: Any) -> bool:
    """A join record as a gpuherd node writes it (at least its number of workers)."""
    return isinstance(record, dict) and isinstance(record.get("nproc"), int) and record["nproc"] > 0
