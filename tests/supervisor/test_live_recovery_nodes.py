"""A multi-node job's live recovery, the supervisor's side, in milliseconds: the node that lost a
rank claims the rebuilt group before its spare is promoted (a lost claim falls back, the spare
kept), and every other node records the same recovery with its own ranks as the survivors
(the real processes: tests/e2e/test_multinode_live_recovery_run.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from gpuherd.status_records import from_object as record
from supervisor.gpus import DeviceSlot
from supervisor.processes import LiveRecovery
from tests.supervisor.test_live_recovery import FakePool, FakeProc, _cause, warnings  # noqa: F401 - a fixture


class FakeRegroup:
    """The job store's claims: first writer of a generation wins."""

    def __init__(self, taken: dict[int, dict] | None = None) -> None:
        self.claims: dict[int, dict] = dict(taken or {})

    def claim(self, generation: int, claim: dict[str, Any]) -> str | None:
        if generation in self.claims:
            return f"node {self.claims[generation]['node']} claimed rebuilt group {generation} first"
        self.claims[generation] = {**claim, "node": 1}
        return None

    def follow(self, on_claim) -> None:
        pass

    def stop(self) -> None:
        pass


def _node(node: int, ranks: tuple[int, ...], regroup: FakeRegroup | None = None, budget: int = 2,
          pool: FakePool | None = None) -> tuple[LiveRecovery, list[dict]]:
    metrics: list[dict] = []
    live = LiveRecovery(pool or FakePool(), budget, attempt=0, env_for=lambda slot, spare, g: {"GEN": str(g)},
                        numbered_from=0, write_metric=metrics.append, regroup=regroup or FakeRegroup(), node=node)
    for rank in ranks:
        live.observe(record({"type": "live", "rank": rank, "event": "able", "able": True, "why": None}))
    return live, metrics


def _claim(**more: Any) -> dict[str, Any]:
    return {"node": 1, "rank": 1, "device": "CPU0", "failed": "CPU0 (rank 1) killed by SIGKILL after 3.0 s",
            "kind": "worker-exit", "lost_pid": 11, "replaced_by_pid": 900, **more}


def test_the_node_that_lost_its_only_rank_claims_the_group_and_promotes_its_spare():
    regroup = FakeRegroup()
    live, _ = _node(1, (1,), regroup)
    assert live.why_not(1, []) is None  # the other nodes' ranks hold the state
    new = live.recover(FakeProc(pid=11, rank=1), _cause(), [], now=100.0)[1]
    assert new is not None and new.pid == 900 and live.pool.promoted == [(1, {"GEN": "1"})]
    claim = regroup.claims[1]
    assert (claim["rank"], claim["lost_pid"], claim["replaced_by_pid"]) == (1, 11, 900)
    assert live.in_flight.node == 1 and live.budget == 1


def test_a_claim_another_node_made_first_falls_back_and_keeps_the_spare(warnings):
    pool = FakePool()
    live, metrics = _node(1, (1,), FakeRegroup({1: {"node": 2}}), pool=pool)
    assert live.recover(FakeProc(pid=11, rank=1), _cause(), [], now=100.0)[1] is None
    assert warnings == ["live recovery not possible: node 2 claimed rebuilt group 1 first"]
    assert pool.promoted == [] and [s.pid for s in pool.spares] == [900]  # waits for the next failure
    assert live.recoveries == [] and live.budget == 2


def test_another_nodes_claim_is_this_nodes_recovery_too_ended_by_its_own_survivors(warnings):
    live, metrics = _node(0, (0,))
    for step in range(6):
        live.observe(record({"type": "step", "rank": 0, "step": step}))
    assert live.heard(1, _claim(), [FakeProc(pid=10, rank=0)], now=50.0) is None
    rec = live.in_flight
    assert (rec.number, rec.node, rec.rank, rec.replaced_by_pid) == (1, 1, 1, 900)
    assert rec.survivors == [{"rank": 0, "pid": 10}] and live.budget == 1  # counted alike on every node
    assert "node 1: CPU0 (rank 1) killed by SIGKILL after 3.0 s: live recovery 1" in warnings[0]
    live.observe(record({"type": "live", "rank": 0, "event": "lost_peer", "generation": 1, "step": 6}))
    live.observe(record({"type": "step", "rank": 0, "step": 6}))  # before the rebuilt group: not its end
    assert live.in_flight is rec
    live.observe(record({"type": "live", "rank": 0, "event": "rejoined", "generation": 1, "step": 6, "source": 0,
                  "role": "source", "seconds": 0.4}))
    live.observe(record({"type": "step", "rank": 0, "step": 6}))
    assert rec.outcome == "recovered" and rec.resumed_step == 6 and rec.source_rank == 0
    assert rec.steps_redone == 0 and metrics[-1]["type"] == "recovery" and metrics[-1]["node"] == 1
    assert "live recovery 1: node 1's rank 1 (CPU0, pid 11) replaced by that node's spare pid 900" in warnings[-1]


def test_this_nodes_own_claim_coming_back_is_not_a_second_recovery():
    live, _ = _node(1, (1,))
    live.recover(FakeProc(pid=11, rank=1), _cause(), [], now=100.0)
    assert live.heard(1, _claim(), [], now=100.1) is None and len(live.recoveries) == 1


def test_a_claim_this_node_cannot_take_part_in_ends_the_attempt_with_the_reason():
    live, _ = _node(0, (0,))
    assert "the claim of rebuilt group 1 on the job store is unreadable" in live.heard(1, None, [], now=1.0)
    live, _ = _node(0, ())  # rank 0 never said it could be recovered: it had not started training
    why = live.heard(1, _claim(), [FakeProc(pid=10, rank=0)], now=1.0)
    assert why.startswith("live recovery not possible: node 1's rank 1 was lost and is being replaced, but this "
                          "node's rank 0 had not started training yet")
    live, _ = _node(0, (0,))
    live.heard(1, _claim(), [FakeProc(pid=10, rank=0)], now=1.0)
    why = live.heard(2, _claim(node=2, rank=2), [FakeProc(pid=10, rank=0)], now=2.0)
    assert "a second failure during a recovery" in why
    assert live.recoveries[0].outcome == "failed"  # the one in flight failed with it


def test_a_survivor_that_rejoined_before_the_claim_was_heard_still_ends_the_recovery():
    live, _ = _node(2, (2,))
    live.observe(record({"type": "live", "rank": 2, "event": "lost_peer", "generation": 1, "step": 4}))
    live.observe(record({"type": "live", "rank": 2, "event": "rejoined", "generation": 1, "step": 4, "source": 0,
                  "role": "survivor", "seconds": 0.3}))
    live.heard(1, _claim(), [FakeProc(pid=12, rank=2)], now=10.0)
    live.observe(record({"type": "step", "rank": 2, "step": 4}))
    rec = live.recoveries[0]
    assert rec.outcome == "recovered" and (rec.resumed_step, rec.source_rank) == (4, 0)


def _shrinking_node(node: int, ranks: tuple[int, ...], regroup: FakeRegroup, floor: int = 2, spares: int = 0,
                    told: list | None = None) -> LiveRecovery:
    """One node of a 4-rank job with --min-replicas `floor`; `told`: node 0's workers' store."""
    live = LiveRecovery(FakePool(spares), 3, attempt=0, env_for=lambda slot, spare, g: {"GEN": str(g)},
                        numbered_from=0, write_metric=lambda m: None, regroup=regroup, node=node, shrink_floor=floor,
                        tell=None if told is None else (lambda key, value: told.append((key, orjson.loads(value)))
                                                        or True), world_size=4)
    for rank in ranks:
        live.observe(record({"type": "live", "rank": rank, "event": "able", "able": True, "why": None}))
    return live


def _first_step_in(live: LiveRecovery, generation: int, rank: int, step: int) -> None:
    live.observe(record({"type": "live", "rank": rank, "event": "rejoined", "generation": generation, "step": step,
                         "source": 0, "role": "survivor", "seconds": 0.3}))
    live.observe(record({"type": "step", "rank": rank, "step": step}))


def test_a_rank_lost_on_node_1_with_no_spare_there_shrinks_the_jobs_group_and_node_0_tells_the_workers(warnings):
    """Node 1 (ranks 2, 3) claims the shrink with its decision; node 0 (ranks 0, 1), whose helper
    hosts the workers' store, writes the decision there; both record it; node 0's warm spare
    cannot take node 1's rank back (another machine's device)."""
    regroup, told = FakeRegroup(), []
    one = _shrinking_node(1, (2, 3), regroup)
    zero = _shrinking_node(0, (0, 1), regroup, spares=1, told=told)
    zero.pool.said_warm(900)
    assert one.shrinks() and one.why_not(3, [2]) is None
    assert one.recover(FakeProc(pid=13, rank=3), _cause(3), [FakeProc(pid=12, rank=2)], now=100.0)[0]
    claim = regroup.claims[1]
    assert claim["action"] == "shrink" and claim["decision"] == {"shrink": 3, "ranks": [0, 1, 2]}
    assert (claim["rank"], claim["lost_pid"], claim["replaced_by_pid"]) == (3, 13, 0)
    assert zero.heard(1, claim, [FakeProc(pid=10, rank=0), FakeProc(pid=11, rank=1)], now=100.2) is None
    assert told == [("gpuherd-live/1/decision", {"shrink": 3, "ranks": [0, 1, 2]})]
    for live, survivor in ((one, 2), (zero, 0)):
        rec = live.in_flight
        assert (rec.action, rec.node, rec.rank, rec.replicas) == ("shrink", 1, 3, 3) and live.group == [0, 1, 2]
        _first_step_in(live, 1, survivor, 9)
        assert rec.outcome == "recovered" and rec.resumed_step == 9 and live.budget == 2
    assert zero.recoveries[0].survivors == [{"rank": 0, "pid": 10}, {"rank": 1, "pid": 11}]
    assert "live recovery 1: node 1's rank 3 (CPU3, pid 13) lost with no spare left" in warnings[-1]
    assert zero.carried() == [] and zero.regrow_candidate() is None  # node 1's rank is node 1's to take back
    assert zero.carried_elsewhere() == {3: 1} and one.carried_elsewhere() == {}  # `gpuherd spare` on node 0 says so
    assert one.carried() == [3]


def test_node_1s_refilled_spare_grows_the_jobs_group_back_and_every_node_records_it():
    regroup, told = FakeRegroup(), []
    one = _shrinking_node(1, (2, 3), regroup, spares=1)
    one.pool.spares[0].returncode = 137  # the standing spare died: no spare left
    zero = _shrinking_node(0, (0, 1), regroup, told=told)
    survivors0 = [FakeProc(pid=10, rank=0), FakeProc(pid=11, rank=1)]
    one.recover(FakeProc(pid=13, rank=3), _cause(3), [FakeProc(pid=12, rank=2)], now=100.0)
    zero.heard(1, regroup.claims[1], survivors0, now=100.0)
    _first_step_in(one, 1, 2, 9)
    _first_step_in(zero, 1, 0, 9)
    one.pool.said_warm(901)  # the refill
    assert one.regrow_candidate() == 3
    new = one.regrow(DeviceSlot(3, "cpu", 3), Path("/dev/null"), [FakeProc(pid=12, rank=2)], now=130.0)
    assert new is not None and new.pid == 901 and one.pool.promoted == [(3, {"GEN": "2"})]
    claim = regroup.claims[2]
    assert claim["action"] == "regrow" and claim["decision"] == {"regrow": 3, "ranks": [0, 1, 2, 3]}
    assert claim["replaced_by_pid"] == 901 and claim["kind"] == "regrow"
    assert zero.heard(2, claim, survivors0, now=130.1) is None
    assert told[-1] == ("gpuherd-live/2/decision", {"regrow": 3, "ranks": [0, 1, 2, 3]})
    one.observe(record({"type": "live", "rank": 3, "event": "first_step", "generation": 2, "step": 20}))
    _first_step_in(zero, 2, 0, 20)
    for live in (one, zero):
        shrink, regrow = live.recoveries
        assert (regrow.action, regrow.outcome, regrow.node, regrow.replaced_by_pid) == ("regrow", "recovered", 1, 901)
        assert shrink.shrunk_s == regrow.shrunk_s and 20.0 <= regrow.shrunk_s <= 40.0
        assert live.group is None and live.state.carried == {} and live.budget == 2  # a regrow uses no restart


def test_a_node_shrinks_only_while_the_job_keeps_its_floor_and_the_node_a_rank_of_its_own():
    one = _shrinking_node(1, (2, 3), FakeRegroup(), floor=4)
    assert one.why_not(3, [2]) == "no spare left, and 3 survivor(s) are fewer than --min-replicas 4"
    alone = _shrinking_node(1, (1,), FakeRegroup())  # one rank per node: node 1 would be left empty
    assert "rank 1 was its last training rank" in alone.why_not(1, [])


def test_a_shrink_or_regrow_claim_a_node_cannot_follow_ends_the_attempt():
    zero = _shrinking_node(0, (0, 1), FakeRegroup(), floor=0)
    claim = _claim(rank=3, action="shrink", decision={"shrink": 3, "ranks": [0, 1, 2]})
    assert "this node does not shrink" in zero.heard(1, claim, [FakeProc(pid=10, rank=0)], now=1.0)
    zero = _shrinking_node(0, (0, 1), FakeRegroup())
    claim = _claim(rank=3, action="regrow", decision={"regrow": 3, "ranks": [0, 1, 2, 3]})
    assert "rank 3 is not carried here" in zero.heard(1, claim, [FakeProc(pid=10, rank=0)], now=1.0)
    claim = _claim(rank=3, action="shrink", decision={"shrink": 3, "ranks": "all"})
    assert "names no group of ranks" in zero.heard(1, claim, [FakeProc(pid=10, rank=0)], now=1.0)


def test_node_0_writes_its_own_shrink_at_once_and_every_nodes_spare_promotion_for_survivors_that_wait(warnings):
    """With --min-replicas every survivor waits for the decision in node 0's workers' store, a
    spare's promotion on another node included; node 0's own shrink it writes itself."""
    regroup, told = FakeRegroup(), []
    zero = _shrinking_node(0, (0, 1), regroup, told=told)
    assert zero.heard(1, _claim(rank=3, action="replaced", decision={"spare": 3}), [FakeProc(pid=10, rank=0)],
                      now=1.0) is None
    assert told == [("gpuherd-live/1/decision", {"spare": 3})] and zero.in_flight.action == "replaced"
    _first_step_in(zero, 1, 0, 5)
    assert zero.recover(FakeProc(pid=10, rank=0), _cause(0), [FakeProc(pid=11, rank=1)], now=2.0)[0]
    assert told[-1] == ("gpuherd-live/2/decision", {"shrink": 0, "ranks": [1, 2, 3]})
    assert regroup.claims[2]["decision"] == {"shrink": 0, "ranks": [1, 2, 3]}
    assert "rank 1 leads in its place" in warnings[-1] and "the other 3 worker(s) of the job" in warnings[-1]
