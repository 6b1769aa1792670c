"""A node lost whole with no spare node, as a surviving node accounts for it, in milliseconds: node
0's shrink claim naming the dead node (kind `node`) is recorded as a shrink of its ranks (counted
against --max-restarts, the group now the claim's survivors, ended at the first completed step of
the rebuilt group); the summary and the report say a node died whole; a node whose ranks hold
shards (fsdp) cannot follow it and says why (the restart). The real processes:
tests/e2e/test_multinode_shrink_run.py."""

from __future__ import annotations

from dataclasses import replace

import orjson

from gpuherd.status_records import decode
from gpuherd.status_records import from_object as record
from supervisor.views.events import event_of
from tests.supervisor.test_live_recovery import FakeProc, warnings  # noqa: F401 - a fixture
from tests.supervisor.test_live_recovery_nodes import _node
from tests.supervisor.test_summary_block import _summary

CLAIM = {"node": 2, "rank": 3, "ranks": [3, 4], "device": "node 2", "kind": "node", "lost_pid": 0, "replaced_by_pid": 0,
         "failed": "node 2 (h2) stopped responding: its connection to node 0 closed without a goodbye",
         "action": "shrink", "decision": {"shrink": 3, "ranks": [0, 1, 2]}}


def _shrinking(ranks: tuple[int, ...]):
    live, metrics = _node(1, ranks)
    live.rules = replace(live.rules, shrink_floor=2, world_size=5)
    return live, metrics


def test_a_survivor_records_a_node_lost_whole_as_a_shrink_of_its_ranks(warnings):
    live, metrics = _shrinking((1, 2))
    survivors = [FakeProc(pid=11, rank=1), FakeProc(pid=12, rank=2)]
    assert live.heard(1, {**CLAIM, "died_at": 0.0}, survivors, now=50.0) is None
    rec = live.in_flight
    assert (rec.action, rec.kind, rec.node, rec.rank, rec.replicas, live.budget) == ("shrink", "node", 2, 3, 3, 1)
    assert live.members() == [0, 1, 2] and live.carried() == [] and live.regrow_candidate() is None
    assert live.carried_elsewhere() == {} and live.dead_nodes() == (2,)  # `gpuherd spare` says it cannot come back
    assert "this node's 2 worker(s) keep running and go on without node 2's rank(s) 3, 4" in warnings[0]
    for rank in (1, 2):
        live.observe(record({"type": "live", "rank": rank, "event": "lost_peer", "generation": 1, "step": 7}))
        live.observe(record({"type": "live", "rank": rank, "event": "rejoined", "generation": 1, "step": 7,
                             "source": 0, "role": "survivor", "seconds": 0.2}))
    live.observe(record({"type": "step", "rank": 1, "step": 7}))
    assert rec.outcome == "recovered" and rec.steps_redone == 0
    assert "live recovery 1: node 2 died whole with no spare node left: 3 process(es) on the other nodes" in \
        warnings[-1]
    event = event_of(decode(orjson.dumps(metrics[-1]), supervisor=True))
    assert event.kind == "recovery" and "node 2 died whole with no spare node left: 3 process(es)" in event.text
    (shown,) = live.settle()
    assert shown["shrunk_s"] > 0  # shrunk to the attempt's end: the dead node does not come back
    lost = {"node": 2, "outcome": "lost (h2): it died whole and the job went on without its ranks (--min-replicas)"}
    block = _summary(None, 0, recoveries=[shown], node_outcomes=[{"node": 0, "exit_code": 0, "outcome": "success"},
                                                                  lost]).block()
    assert "live recovery 1: node 2 died whole -> no spare node left: 3 process(es) on the other nodes" in block
    assert f"node 2: {lost['outcome']}" in block  # node 0's summary lists it as lost


def test_a_node_whose_ranks_hold_shards_cannot_follow_it(warnings):
    live, _ = _shrinking((1,))
    live.observe(record({"type": "live", "rank": 1, "event": "able", "able": True, "why": None,
                         "no_shrink": "its shard cannot be spread over fewer ranks"}))
    why = live.heard(1, {**CLAIM, "died_at": 0.0}, [FakeProc(pid=11, rank=1)], now=50.0)
    assert why == ("live recovery not possible: node 2's rank 3 was lost and is being replaced, but this node's rank "
                   "1: its shard cannot be spread over fewer ranks; restarting every worker")
