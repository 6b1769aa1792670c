"""A live recovery's claim (live_claim.py), decoded once where it comes off the job store: a value
no gpuherd node writes is no claim, a field of the wrong type reads as not said, and the
supervisor that hears such a claim records it instead of crashing (the store has no authentication)."""

from __future__ import annotations

from supervisor.rendezvous import LiveClaim, decode_claim
from tests.supervisor.test_live_recovery_nodes import FakeProc, _claim, _node


def test_a_claim_as_a_node_writes_it_reads_back_whole():
    claim = decode_claim({"node": 2, "rank": 3, "ranks": [3, 4], "device": "node 2", "kind": "node", "lost_pid": 0,
                          "replaced_by_pid": 0, "died_at": 12.5, "failed": "node 2 stopped responding",
                          "action": "shrink", "decision": {"shrink": 3, "ranks": [0, 1, 2]}})
    assert claim == LiveClaim(node=2, rank=3, ranks=(3, 4), device="node 2", kind="node", died_at=12.5,
                              failed="node 2 stopped responding", action="shrink",
                              decision={"shrink": 3, "ranks": [0, 1, 2]}, group=(0, 1, 2), decided=3)


def test_a_value_without_a_node_and_a_rank_is_no_claim():
    for value in (None, [1], "claim", {"node": 1}, {"node": "1", "rank": 1}, {"node": True, "rank": 1}):
        assert decode_claim(value) is None, value


def test_a_field_of_the_wrong_type_reads_as_not_said():
    claim = decode_claim({"node": 1, "rank": 1, "lost_pid": "11", "died_at": "yesterday", "action": 7,
                          "decision": {"replaced": 1, "ranks": "all"}, "spare_node": 3.0, "ranks": [1, "2"]})
    assert (claim.lost_pid, claim.died_at, claim.action, claim.group, claim.spare_node, claim.ranks) == \
        (0, None, "replaced", None, None, None)


def test_a_claim_with_foreign_fields_is_still_recorded_as_this_nodes_recovery():
    """Another node's claim, as read off the store, with a pid and a time no gpuherd node writes:
    the survivor records the recovery (the pid unknown, the loss now), where it used to crash."""
    live, _ = _node(0, (0,))
    assert live.heard(1, _claim(lost_pid="eleven", replaced_by_pid=[900], died_at="now"),
                      [FakeProc(pid=10, rank=0)], now=50.0) is None
    rec = live.in_flight
    assert (rec.node, rec.rank, rec.lost_pid, rec.replaced_by_pid) == (1, 1, 0, 0)
