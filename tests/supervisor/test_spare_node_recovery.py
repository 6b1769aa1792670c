"""A spare node's promotion as every node accounts for it, in milliseconds: a survivor records the
claim naming a spare node as a `spare-node` recovery; the spare node itself records it when its
workers start (numbered, counted against --max-restarts, ended at its newcomer's first completed
step), ignores the claims made before it joined and expects the next group after its own; the
metrics record reads back as the report's event (the real processes:
tests/e2e/test_multinode_live_recovery_run.py)."""

from __future__ import annotations

import orjson

from gpuherd.status_records import decode
from gpuherd.status_records import from_object as record
from supervisor.views.events import event_of
from tests.supervisor.test_live_recovery import FakeProc, warnings  # noqa: F401 - a fixture
from tests.supervisor.test_live_recovery_nodes import _node

CLAIM = {"node": 2, "rank": 2, "ranks": [2], "device": "node 2", "kind": "node", "lost_pid": 0, "replaced_by_pid": 0,
         "failed": "node 2 (h2) stopped responding: its connection to node 0 closed without a goodbye",
         "spare_node": 3, "spare_host": "h3"}


def test_a_survivor_records_the_spare_nodes_promotion_and_the_report_reads_it(warnings):
    live, metrics = _node(0, (0,))
    assert live.heard(1, {**CLAIM, "died_at": 0.0}, [FakeProc(pid=10, rank=0)], now=50.0) is None
    rec = live.in_flight
    assert (rec.action, rec.spare_node, rec.node, rec.rank, live.budget) == ("spare-node", 3, 2, 2, 1)
    assert "spare node 3 (h3) takes its ranks [2]; this node's 1 worker(s) keep running" in warnings[0]
    live.observe(record({"type": "live", "rank": 0, "event": "lost_peer", "generation": 1, "step": 7}))
    live.observe(record({"type": "live", "rank": 0, "event": "rejoined", "generation": 1, "step": 7, "source": 0,
                         "role": "source", "seconds": 0.2}))
    live.observe(record({"type": "step", "rank": 0, "step": 7}))
    assert rec.outcome == "recovered" and rec.steps_redone == 0
    assert "node 2 died whole; spare node 3 took its ranks (from rank 2)" in warnings[-1]
    event = event_of(decode(orjson.dumps(metrics[-1]), supervisor=True))
    assert event.kind == "recovery" and "node 2 died whole; spare node 3 took its ranks" in event.text


def test_the_spare_node_records_its_own_promotion_and_follows_on_from_its_group(warnings):
    live, metrics = _node(2, ())
    newcomer = FakeProc(pid=77, rank=2)
    live.promoted(2, CLAIM, [newcomer], now=30.0)
    rec = live.in_flight
    assert (rec.action, rec.replaced_by_pid, rec.survivors, live.budget) == ("spare-node", 77, [], 1)
    assert "this spare node takes node 2's ranks 2 (pid(s) 77)" in warnings[0]
    assert live.heard(1, {**CLAIM, "node": 1, "rank": 1}, [newcomer], now=30.1) is None  # before it joined
    assert live.heard(2, CLAIM, [newcomer], now=30.1) is None and len(live.recoveries) == 1  # its own
    live.observe(record({"type": "live", "rank": 2, "event": "rejoined", "generation": 2, "step": 5, "source": 0,
                         "role": "newcomer", "seconds": 0.3}))
    live.observe(record({"type": "live", "rank": 2, "event": "first_step", "generation": 2, "step": 6}))
    assert rec.outcome == "recovered" and (rec.resumed_step, rec.rejoin_s) == (5, 0.3)
    assert live.next_generation == 3  # the job's next rebuilt group, not this node's second
