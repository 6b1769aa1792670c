"""The hang judge's view of the kernel is the /proc samples it is given, nothing it reads itself:
these verdicts come from samples written by hand, with no process behind them."""

from __future__ import annotations

from gpuherd.status_records import from_object as rec
from supervisor.health import HangPolicy, Heartbeats, LearnedTimeouts, ProcSample, ProcTracker

POLICY = HangPolicy(step_default=300, startup=900, factor=5, floor=10)


def _two_ranks_at_step_7() -> tuple[Heartbeats, list[dict]]:
    written: list[dict] = []
    hb = Heartbeats([0, 1], 0.0, LearnedTimeouts(POLICY), rendezvous=600, expect_heartbeats=False,
                    write_metric=written.append)
    for rank in (0, 1):
        hb.record(rank, rec({"type": "step", "rank": rank, "step": 7}), 1.0)
    return hb, written


def _samples(cpu: float, **letters: str) -> list[ProcSample]:
    return [ProcSample(int(rank[1:]), letter, cpu) for rank, letter in letters.items()]


def test_a_rank_the_samples_show_stopped_is_named_long_before_any_allowance():
    hb, written = _two_ranks_at_step_7()
    assert hb.check(2.0, {0, 1}, _samples(1.0, r0="S", r1="T")) is None  # stopped for 0 s: a passing look
    assert hb.check(4.0, {0, 1}, _samples(1.0, r0="S", r1="T")) is None  # 2 s
    verdict = hb.check(5.0, {0, 1}, _samples(1.0, r0="S", r1="T"))  # 3 s in state T while rank 0 runs
    assert verdict is not None and verdict.rank == 1 and "stopped by a signal (state T)" in verdict.message
    assert [(m.rank, m.state) for m in written] == [(1, "T")]  # goodput's mark, once, from the samples


def test_without_samples_the_judge_knows_nothing_of_the_kernel():
    hb, written = _two_ranks_at_step_7()
    for now in (2.0, 5.0, 60.0):
        assert hb.check(now, {0, 1}) is None  # silence alone, within the 300 s allowance
    assert hb.procs.state(1) is None and written == []


def test_the_tracker_says_since_when_a_state_holds_and_how_busy_the_cpu_was():
    tracker = ProcTracker()
    assert tracker.add([ProcSample(0, "R", 10.0)], 1.0) == []
    tracker.add([ProcSample(0, "R", 10.5)], 2.0)
    state = tracker.state(0)
    assert (state.letter, state.since, state.cpu_busy) == ("R", 1.0, 0.5)
    assert tracker.add([ProcSample(0, "T", 10.5)], 3.0) == [(0, "T")]
    assert tracker.add([ProcSample(0, "R", 10.5)], 9.0) == [(0, "R")]  # running again: said too
    tracker.forget(0)  # a spare took the rank: its process is another one
    assert tracker.state(0) is None
