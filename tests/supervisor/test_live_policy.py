"""Live recovery's decisions (supervisor/processes/live_policy.py), driven with synthetic events:
replace with a warm spare, shrink, refuse below the floor, regrow, a spare node, another node's
claim, give up (the reason given), --max-restarts counted once. No process, no file: each test
runs in microseconds. The shell that carries the actions out (live_recovery.py) keeps its own
tests (test_live_recovery*.py), and the real processes run in tests/e2e/test_*live_recovery_run.py."""

from __future__ import annotations

import pytest

from supervisor.processes import live_policy as lp

ONE_NODE = lp.Rules(world_size=4)
SHRINKING = lp.Rules(world_size=4, shrink_floor=2)
NODE_1 = lp.Rules(world_size=4, shrink_floor=2, node=1, multi_node=True)  # ranks 2, 3 of a 2-node job
ABLE = {r: None for r in range(4)}


class Live:
    """One attempt's live recovery: feed events, keep the state."""

    def __init__(self, rules: lp.Rules = ONE_NODE, budget: int = 2, able: dict | None = None) -> None:
        self.rules, self.state = rules, lp.State(budget=budget, able=dict(ABLE if able is None else able))

    def __call__(self, event: lp.Event) -> tuple[lp.Action, ...]:
        self.state, actions = lp.decide(self.state, event, self.rules)
        return actions

    def lose(self, rank: int, survivors: tuple[int, ...] | None = None, spare_ready: bool = True, **more) -> tuple:
        survivors = tuple(r for r in range(4) if r != rank) if survivors is None else survivors
        return self(lp.Lost(rank, survivors, spare_ready=spare_ready, **more))


def test_a_lost_rank_with_a_warm_spare_is_promoted_recorded_and_the_pool_refilled():
    live = Live()
    assert live.lose(1) == (lp.Promote(1, generation=1),)
    assert live.state.budget == 2  # nothing counted before the spare is in place
    assert live(lp.Done()) == (lp.Record("replaced", 1, nth=1, generation=1, node=None), lp.FillPool("refill"))
    assert (live.state.budget, live.state.in_flight, live.state.next_generation) == (1, 1, 2)


def test_the_last_restart_a_promotion_uses_starts_no_spare_for_a_failure_that_cannot_be_recovered():
    live = Live(budget=1)
    live.lose(1)
    assert live(lp.Done()) == (lp.Record("replaced", 1, nth=1, generation=1, node=None),)


def test_with_min_replicas_the_survivors_wait_for_the_word_on_a_spare_too():
    live = Live(SHRINKING)
    assert live.lose(2) == (lp.Promote(2, generation=1, tell=True),)


def test_with_no_spare_and_min_replicas_the_group_shrinks_and_the_pool_refills_for_a_regrow():
    live = Live(SHRINKING)
    assert live.lose(2, spare_ready=False) == (lp.Shrink(2, (0, 1, 3), generation=1),)
    assert live(lp.Done()) == (lp.FillPool("regrow"), lp.Record("shrink", 2, 1, 1, None, (0, 1, 3)))
    assert live.state.group == (0, 1, 3) and lp.carried(live.state) == [2] and live.state.budget == 1


def test_a_shrunk_group_shrinks_again_even_with_a_spare_ready_since_no_spare_can_join_it():
    live = Live(SHRINKING, budget=3)
    live.lose(2, spare_ready=False)
    live(lp.Done())
    live(lp.Ended(recovered=True))
    assert live.lose(3, survivors=(0, 1), spare_ready=True) == (lp.Shrink(3, (0, 1), generation=2),)


def test_a_rank_whose_gpu_is_suspect_shrinks_rather_than_hand_a_spare_its_gpu():
    assert Live(SHRINKING).lose(2, suspect_gpu=True) == (lp.Shrink(2, (0, 1, 3), generation=1),)
    (give_up,) = Live(ONE_NODE).lose(2, suspect_gpu=True)
    assert give_up.why.startswith("rank 2's GPU is a suspect device and a warm spare takes a rank on the rank's own")


def test_a_shrink_below_the_floor_gives_up_saying_so_and_leaves_the_restart_to_the_supervision():
    live = Live(lp.Rules(world_size=4, shrink_floor=3))
    assert live.lose(3, survivors=(0, 1), spare_ready=False) == (
        lp.GiveUp("no spare left, and 2 survivor(s) are fewer than --min-replicas 3"),)
    assert live.state.budget == 2 and live.state.pending is None and live.state.group is None


def test_a_sharded_rank_is_never_shrunk_away():
    live = Live(SHRINKING)
    live(lp.Able(2, no_shrink="its shard cannot be spread over fewer ranks"))
    (give_up,) = live.lose(2, spare_ready=False)
    assert give_up.why == "no spare left, and rank 2: its shard cannot be spread over fewer ranks"


def test_a_node_left_with_no_rank_of_its_own_does_not_shrink():
    (give_up,) = Live(NODE_1, able={3: None}).lose(3, survivors=(), spare_ready=False)
    assert give_up.why.startswith("no spare left on this node (node 1), and rank 3 was its last training rank")


@pytest.mark.parametrize(("rules", "state", "why"), [
    (lp.Rules(world_size=4, off="a --script run (x)"), {}, "a --script run (x)"),
    (ONE_NODE, {"in_flight": 0}, "a second failure during a recovery (rank 0 was being replaced)"),
    (ONE_NODE, {"budget": 0}, "no restart left for it (--max-restarts counts recoveries and restarts alike)"),
    (ONE_NODE, {"able": {1: None}}, "rank 0 had not started training yet (no state to hand over)"),
    (lp.Rules(world_size=4, script=True), {"able": {1: None}}, "rank 0's script had not called gpuherd.live.attach"),
    (ONE_NODE, {"able": {0: "strategy fsdp shards its state", 1: None}}, "rank 0: strategy fsdp shards its state"),
])
def test_where_live_recovery_cannot_apply_it_gives_up_with_the_reason(rules, state, why):
    live = Live(rules)
    live.state = lp.State(**{"budget": 2, "able": dict(ABLE), **state})
    (give_up,) = live.lose(1, survivors=(0,))
    assert isinstance(give_up, lp.GiveUp) and give_up.why.startswith(why)
    assert live.state.in_flight is None  # a recovery in flight failed with it
    assert give_up.in_flight == ("in_flight" in state)


def test_every_rank_lost_gives_up_on_one_node_but_not_where_other_nodes_hold_the_state():
    (give_up,) = Live(able={0: None}).lose(0, survivors=())
    assert give_up.why == "every rank was lost: no survivor holds the state"
    assert Live(lp.Rules(world_size=4, node=1, multi_node=True)).lose(3, survivors=()) == (lp.Promote(3, 1),)


def test_a_promotion_refused_gives_up_with_its_reason_and_counts_nothing():
    live = Live()
    live.lose(1)
    assert live(lp.Refused("no warm spare left (--spares)")) == (lp.GiveUp("no warm spare left (--spares)"),)
    assert live.state.budget == 2 and live.state.recorded == 0 and live.state.pending is None


def _shrunk(budget: int = 3) -> Live:
    """Four ranks, --min-replicas 2: rank 2 was lost with no spare, the group rebuilt as 0, 1, 3."""
    live = Live(SHRINKING, budget=budget)
    live.lose(2, spare_ready=False)
    live(lp.Done())
    live(lp.Ended(recovered=True))
    return live


def test_a_warm_spare_takes_back_the_carried_rank_and_uses_no_restart():
    live = _shrunk()
    assert lp.regrow_candidate(live.state) == 2
    assert live(lp.SpareWarm(2, pid=901)) == (lp.Regrow(2, (0, 1, 2, 3), generation=2),)
    assert live(lp.Done()) == (lp.Record("regrow", 2, 2, 2, None, (0, 1, 2, 3)),)
    assert live.state.group is None and live.state.carried == {} and live.state.budget == 2


def test_a_group_shrunk_twice_grows_back_the_rank_an_operator_asked_for_and_stays_shrunk_until_the_last():
    live = _shrunk()
    live.lose(3, survivors=(0, 1))
    live(lp.Done())
    assert lp.regrow_candidate(live.state) is None  # the second shrink still in flight
    live(lp.Ended(recovered=True))
    assert lp.regrow_candidate(live.state) == 2 and lp.regrow_candidate(live.state, asked=3) == 3
    live(lp.SpareWarm(3, pid=902))
    live(lp.Done())
    assert live.state.group == (0, 1, 3) and lp.carried(live.state) == [2]


def test_no_regrow_once_training_finished_and_none_for_a_rank_no_longer_carried():
    live = _shrunk()
    assert live(lp.SpareWarm(1, pid=901)) == () and live.state.pending is None
    live(lp.TrainingDone())
    assert lp.regrow_candidate(live.state) is None


def test_a_regrow_refused_keeps_the_shrunk_group_and_only_warns():
    live = _shrunk()
    live(lp.SpareWarm(2, pid=901))
    (warn,) = live(lp.Refused("the rendezvous store is gone, so the workers cannot be told", spare=901))
    assert warn == lp.Warn("regrow not possible: the rendezvous store is gone, so the workers cannot be told "
                           "(warm spare pid 901 was to take back rank 2)")
    assert live.state.group == (0, 1, 3) and lp.regrow_candidate(live.state) == 2


def test_a_spare_node_taking_a_dead_nodes_ranks_is_one_recovery_and_the_jobs_groups_count_on_from_it():
    live = Live(lp.Rules(world_size=4, node=3, multi_node=True))
    assert live(lp.SpareNodeJoined(generation=2, rank=2, node=2)) == (lp.Record("spare-node", 2, 1, 2, 2),)
    assert (live.state.budget, live.state.in_flight, live.state.next_generation) == (1, 2, 3)
    assert live(lp.Heard(1, lp.Claim(1, 1), survivors=(2, 3))) == ()  # made before it joined
    assert live(lp.Heard(2, lp.Claim(3, 2), survivors=(2, 3))) == ()  # its own


def test_another_nodes_spare_node_claim_is_this_nodes_recovery_too():
    live = Live(lp.Rules(world_size=6, node=0, multi_node=True))
    actions = live(lp.Heard(1, lp.Claim(2, 2, spare_node=3), survivors=(0, 1)))
    assert actions == (lp.Record("spare-node", 2, 1, 1, 2, remote=True),) and live.state.budget == 1


def test_another_nodes_replacement_is_counted_here_alike():
    live = Live(lp.Rules(world_size=4, node=0, multi_node=True))
    assert live(lp.Heard(1, lp.Claim(1, 1), survivors=(0,))) == (lp.Record("replaced", 1, 1, 1, 1, remote=True),)
    assert live.state.budget == 1 and live.state.in_flight == 1


def test_another_nodes_shrink_is_told_by_node_0_counted_and_its_rank_carried_there():
    live = Live(lp.Rules(world_size=4, shrink_floor=2, node=0, multi_node=True))
    decision = {"shrink": 3, "ranks": [0, 1, 2]}
    actions = live(lp.Heard(1, lp.Claim(1, 3, "shrink", (0, 1, 2), decision), survivors=(0, 1)))
    assert actions == (lp.Tell(1, decision), lp.Record("shrink", 3, 1, 1, 1, (0, 1, 2), remote=True))
    assert lp.carried(live.state) == [] and lp.carried_elsewhere(live.state) == {3: 1} and live.state.budget == 1


def test_a_node_that_died_whole_shrinks_the_job_and_stays_carried_until_a_restart():
    live = Live(lp.Rules(world_size=5, shrink_floor=2, node=1, multi_node=True))
    live(lp.Heard(1, lp.Claim(2, 3, "shrink", (0, 1, 2), {"shrink": 3}, whole_node=True), survivors=(1, 2)))
    assert lp.dead_nodes(live.state) == (2,) and lp.carried_elsewhere(live.state) == {}


@pytest.mark.parametrize(("rules", "heard", "why"), [
    (NODE_1, lp.Heard(1, None, (2, 3)), "the claim of rebuilt group 1 on the job store is unreadable"),
    (NODE_1, lp.Heard(2, lp.Claim(0, 1), (2, 3)), "this node expected rebuilt group 1, not 2"),
    (lp.Rules(world_size=4, node=1, multi_node=True), lp.Heard(1, lp.Claim(0, 1, "shrink", (0, 2, 3)), (2, 3)),
     "this node does not shrink (--min-replicas 0 here)"),
    (NODE_1, lp.Heard(1, lp.Claim(0, 1, "shrink"), (2, 3)), "the shrink claimed on the job store names no group"),
    (NODE_1, lp.Heard(1, lp.Claim(0, 1, "regrow", (0, 1, 2, 3)), (2, 3)), "rank 1 is not carried here"),
    (NODE_1, lp.Heard(1, lp.Claim(0, 1), (2, 4)), "this node's rank 4 had not started training yet"),
])
def test_a_claim_this_node_cannot_follow_gives_up_for_the_job_with_the_reason(rules, heard, why):
    (give_up,) = Live(rules)(heard)
    assert give_up.why.startswith("live recovery not possible: ") and why in give_up.why
    assert give_up.why.endswith("; restarting every worker")


def test_a_claim_heard_during_a_recovery_fails_the_one_in_flight():
    live = Live(NODE_1)
    live.lose(3, survivors=(2,))
    live(lp.Done())
    (give_up,) = live(lp.Heard(2, lp.Claim(0, 1), survivors=(2,)))
    assert give_up.in_flight and "on this node: a second failure during a recovery (rank 3" in give_up.why
    assert live.state.in_flight is None


def test_the_budget_is_counted_once_per_recovery_on_every_path_and_never_for_a_regrow():
    live = Live(SHRINKING, budget=3)
    live.lose(1)
    live(lp.Done())  # replaced: 1
    live(lp.Ended(recovered=True))
    live.lose(2, spare_ready=False)
    live(lp.Done())  # shrink: 2
    live(lp.Ended(recovered=True))
    live(lp.SpareWarm(2, pid=901))
    live(lp.Done())  # regrow: not counted
    live(lp.Ended(recovered=True))
    assert live.state.budget == 1 and live.state.recorded == 3
    live.lose(0)
    live(lp.Done())  # replaced: 3, the last
    live(lp.Ended(recovered=True))
    (give_up,) = live.lose(3)
    assert live.state.budget == 0 and give_up.why.startswith("no restart left for it")


def test_a_scripts_first_spares_start_once_a_rank_can_be_recovered_live_and_a_restart_is_left():
    assert Live(able={})(lp.Able(0, spares_due=True)) == (lp.FillPool("first"),)
    assert Live(able={})(lp.Able(0, why="not attached", spares_due=True)) == ()
    assert Live(able={}, budget=0)(lp.Able(0, spares_due=True)) == ()


def test_a_decision_never_changes_the_state_it_was_given():
    live = Live(SHRINKING)
    before = live.state
    after, _ = lp.decide(before, lp.Lost(2, (0, 1, 3), spare_ready=False), SHRINKING)
    lp.decide(after, lp.Done(), SHRINKING)
    assert before == lp.State(budget=2, able=ABLE) and after.pending == lp.Shrink(2, (0, 1, 3), 1)


def test_the_attempt_loop_counts_what_an_attempt_used_by_the_same_rule_as_the_live_budget():
    recoveries = [{"outcome": "recovered", "action": "replaced"}, {"outcome": "recovered", "action": "shrink"},
                  {"outcome": "recovered", "action": "regrow"}, {"outcome": "recovered", "action": "spare-node"},
                  {"outcome": "failed", "action": "replaced"}]  # a failure ended the attempt: a restart counts it
    assert lp.restarts_used(recoveries) == 3
    assert [lp.uses_restart(r["action"]) for r in recoveries] == [True, True, False, True, True]
