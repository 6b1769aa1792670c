"""A slow step is not a hang: a verdict needs evidence of no progress (issue 24, the 75M
model whose first step outlasted the 60 s initial allowance while both ranks computed).
Real hangs are still found at the allowance: a stopped rank, a wedged one, one idle in
state S, one blocked in a collective the computing ranks already left."""

from __future__ import annotations

from gpuherd.status_records import from_object as rec
from supervisor.health import HangPolicy, Heartbeats, LearnedTimeouts
from supervisor.health.evidence import RankSnapshot, progressing
from supervisor.health.proc_state import ProcState

POLICY = HangPolicy(step_default=60, startup=300, factor=5, floor=10)
RUNNING, IDLE, STOPPED = ProcState("R", 0.0, 0.33), ProcState("S", 0.0, 0.0), ProcState("T", 1.0, 0.0)


def alive(step, where, collective=False, phase="step", where_s=1.0):
    return rec({"type": "alive", "phase": phase, "step": step, "for_s": where_s, "where": where, "where_s": where_s,
                "collective": collective})


def view(rank, live, proc, age=0.5):
    return RankSnapshot(rank, live.step, silent_s=age, live=live, live_age_s=age, live_latest=True, proc=proc)


def test_ranks_computing_their_first_step_are_working():
    busy_but_sleeping = ProcState("S", 0.0, 0.4)  # a GPU rank syncing: state S, its CPU still busy
    found = progressing([view(0, alive(0, "forward/backward"), RUNNING),
                         view(1, alive(0, "forward/backward"), busy_but_sleeping)])
    assert set(found) == {0, 1}
    assert found[0] == "rank 0: forward/backward at step 0 for 2 s, state R, CPU busy (33% of a core)"


def test_compile_counts_as_work_and_a_rank_waiting_for_it_is_excused():
    found = progressing([view(0, alive(None, "", phase="compile"), RUNNING),
                         view(1, alive(0, "all_reduce (gradients)", collective=True), IDLE)])
    assert set(found) == {0, 1} and "waiting in all_reduce (gradients)" in found[1]


def test_no_evidence_of_work_is_no_excuse():
    assert progressing([view(0, alive(0, "forward/backward"), IDLE)]) == {}  # state S, CPU idle
    assert progressing([view(0, alive(0, "forward/backward"), STOPPED)]) == {}
    assert progressing([view(0, alive(0, "forward/backward"), RUNNING, age=9)]) == {}  # liveness thread silent
    assert progressing([view(0, alive(0, "forward/backward"), None)]) == {}  # the kernel was not asked
    assert progressing([view(0, alive(0, "preparing the next batch"), RUNNING)]) == {}
    assert progressing([view(0, alive(0, "all_reduce", collective=True), RUNNING)]) == {}


def test_a_rank_blocked_in_a_collective_the_computing_rank_left_is_not_excused():
    found = progressing([view(0, alive(7, "all_reduce (gradients)", collective=True), IDLE),
                         view(1, alive(9, "forward/backward"), RUNNING)])
    assert set(found) == {1}


def _monitor(states: dict[int, ProcState]) -> Heartbeats:
    hb = Heartbeats([0, 1], 0.0, LearnedTimeouts(POLICY), rendezvous=600, expect_heartbeats=True)
    hb.procs.state = states.get  # the kernel's view, as the samples would make it
    return hb


def _first_step(hb: Heartbeats, now: float, where0: str, where1: str, collective1: bool = False) -> None:
    for rank, where, coll in ((0, where0, False), (1, where1, collective1)):
        hb.record(rank, rec({"type": "alive", "rank": rank, "phase": "step", "step": 0, "for_s": now - 1.0,
                             "where": where, "where_s": now - 1.0, "collective": coll}), now)


def test_a_first_step_longer_than_the_initial_allowance_is_waited_for_and_said_once():
    hb = _monitor({0: RUNNING, 1: RUNNING})
    _first_step(hb, 5.0, "forward/backward", "forward/backward")
    for now in (30.0, 61.0, 90.0, 300.0):
        _first_step(hb, now, "forward/backward", "forward/backward")
        assert hb.check(now, {0, 1}) is None
    assert len(hb.notices) == 2  # one per rank for this stretch, not one per check
    assert hb.notices[0].startswith("rank 0: no new step for 89 s, past its allowance (step allowance 60 s "
                                    "(initial; warming up)), but it is working, not hung: rank 0: forward/backward")


def test_working_is_no_excuse_past_the_startup_allowance():
    """A rank spinning in a collective nothing marks (a GPU syncing) looks busy too: never forever."""
    hb = _monitor({0: RUNNING, 1: RUNNING})
    _first_step(hb, 5.0, "forward/backward", "forward/backward")
    _first_step(hb, 300.0, "forward/backward", "forward/backward")
    assert hb.check(300.0, {0, 1}) is None
    assert hb.notices[0].endswith("waiting on, up to 300 s without a new step (the startup allowance)")
    _first_step(hb, 302.0, "forward/backward", "forward/backward")
    verdict = hb.check(302.0, {0, 1})
    assert verdict is not None and "no progress for 301 s" in verdict.message


def test_a_rank_idle_in_state_s_is_still_a_hang_at_the_allowance():
    hb = _monitor({0: IDLE, 1: RUNNING})
    _first_step(hb, 5.0, "forward/backward", "all_reduce (gradients)", collective1=True)
    _first_step(hb, 61.0, "forward/backward", "all_reduce (gradients)", collective1=True)
    verdict = hb.check(62.0, {0, 1})
    assert verdict is not None and verdict.rank == 0 and not hb.notices


def test_a_stopped_rank_is_still_a_hang_at_the_allowance():
    hb = _monitor({0: STOPPED, 1: IDLE})
    _first_step(hb, 5.0, "forward/backward", "all_reduce (gradients)", collective1=True)
    hb.record(1, rec({"type": "alive", "rank": 1, "phase": "step", "step": 0, "for_s": 60.0,
                      "where": "all_reduce (gradients)", "where_s": 60.0, "collective": True}), 61.0)
    verdict = hb.check(62.0, {0, 1})
    assert verdict is not None and verdict.rank == 0 and "process stopped" in verdict.message
