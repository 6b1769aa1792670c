"""The straggler move-out decision, with no process: the factor, the time, noise that must not
act, the evidence, what its pace cost (goodput), the policy's answer (moved out with a spare,
named only without one), and the setting that turns it off."""

from __future__ import annotations

import random
from dataclasses import replace
import signal

import orjson

from gpuherd.status_records import Alive, TimelineStraggler
from supervisor.goodput import account, decode
from supervisor.gpus import DeviceSlot
from supervisor.health import Due, MoveOut, Stragglers
from supervisor.health.proc_state import ProcSample, ProcTracker
from supervisor.health.straggler_moves import Window
from supervisor.processes import policy as pol
from supervisor.processes.live_policy import Carried
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.spares import SparePool
from supervisor.processes.straggler_out import straggler_cause, straggler_spare
from supervisor.summary import RootCause

RULES = pol.Rules(grace=5.0, stop_timeout=120.0, save_signal=signal.SIGUSR2, finish_window=60.0)


def windows(move: MoveOut, slow: dict[int, float], seconds: float, start: float = 0.0, ranks: int = 4,
            step_s: float = 0.1) -> float:
    """5 s windows for `seconds`: every rank computes `step_s` a step, rank r `slow[r]` times that;
    the job's steps go at the slowest rank's pace. Returns the time reached."""
    t = start
    while t < start + seconds - 1e-9:
        per_step = {r: step_s * slow.get(r, 1.0) for r in range(ranks)}
        steps = max(1, int(5.0 / max(per_step.values())))
        move.window(Window(t, t + 5.0, per_step, dict.fromkeys(range(ranks), steps)), baseline=step_s)
        t += 5.0
    return t


def test_a_rank_four_times_slower_is_due_after_the_set_time_not_before():
    move = MoveOut()  # the defaults: 2x for 30 s
    t = windows(move, {2: 4.0}, 25.0)
    assert move.take() == []  # 25 s: not yet
    windows(move, {2: 4.0}, 5.0, start=t)
    (due,) = move.take()
    assert due.rank == 2 and due.slowdown == 4.0 and due.held_s == 30.0 and not due.again
    assert due.evidence["compute_ms_before"] == {"0": 100.0, "1": 100.0, "2": 400.0, "3": 100.0}
    assert due.evidence["step_s_before"] == 0.4167 and due.evidence["baseline_step_s"] == 0.1
    windows(move, {2: 4.0}, 10.0, start=t + 5)
    assert [d.held_s for d in move.take()] == [35.0, 40.0]  # again while it holds: a spare may be warm by then


def test_below_the_factor_or_for_less_than_the_time_nothing_is_due():
    move = MoveOut(factor=2.0, after_s=30.0)
    windows(move, {1: 1.9}, 120.0)  # slow, but under the factor
    t = windows(move, {1: 3.0}, 25.0, start=200.0)  # over it for 25 s, then back to pace for a window
    t = windows(move, {}, 5.0, start=t)
    windows(move, {1: 3.0}, 25.0, start=t)  # over again: the time counts from the new stretch
    assert move.take() == []


def test_noise_that_must_not_act():
    """Every rank's compute jittering up to 1.8x at random (a shared host), and one rank's
    spikes over the factor that never last a whole window run: never due in an hour."""
    rng = random.Random(4)
    move = MoveOut()
    t = 0.0
    for i in range(720):
        per_step = {r: 0.1 * rng.uniform(1.0, 1.8) for r in range(8)}
        if i % 5 == 0:
            per_step[3] = 0.5  # one window in five: 5x
        move.window(Window(t, t + 5.0, per_step, dict.fromkeys(range(8), 10)))
        t += 5.0
    assert move.take() == []


def test_off_setting_names_only():
    move = MoveOut(after_s=0)
    windows(move, {2: 10.0}, 300.0)
    assert move.take() == []


def test_a_rank_moved_out_once_is_due_again_only_as_named():
    move = MoveOut()
    t = windows(move, {2: 4.0}, 30.0)
    (due,) = move.take()
    ev = move.moved(due)
    orjson.dumps(ev)  # it goes into metrics.jsonl and summary.json as it is
    t = windows(move, {}, 10.0, start=t)  # the recovery's window is skipped, the next one measured
    assert ev["step_s_after"] == 0.1 and ev["compute_ms_after"] == {str(r): 100.0 for r in range(4)}
    assert ev["saved_s"] == round(50 * 0.4167 - 5.0, 3)  # its steps at the straggler's pace, minus what they took
    windows(move, {2: 4.0}, 30.0, start=t)  # its replacement is slow too
    (again,) = move.take()
    assert again.again


def test_a_replacements_first_window_after_the_move_is_its_join_not_its_pace():
    """The newcomer's first window holds its join (a script's spare runs the script from its start):
    slow there, it is not judged; slow from the next window on, it is."""
    move = MoveOut(after_s=5.0)
    t = windows(move, {2: 4.0}, 5.0)
    (due,) = move.take()
    move.moved(due)
    t = windows(move, {2: 3.0}, 5.0, start=t)  # its join
    t = windows(move, {}, 5.0, start=t)
    assert move.take() == []
    windows(move, {2: 3.0}, 5.0, start=t)  # slow in a window of its own: the replacement is slow too
    (again,) = move.take()
    assert again.again and again.held_s == 5.0


def _alive(steps: int, compute: float) -> Alive:
    return Alive(rank=0, time=0.0, steps=steps, compute_s=compute)


def test_stragglers_cost_a_named_ranks_pace_and_hand_it_over_when_due():
    """Through the straggler windows the supervisor keeps: named after 3 windows, due after 30 s,
    and its stretch's cost in a `timeline`/`straggler` record once it is moved out."""
    written, warned = [], []
    s = Stragglers(1.3, 3, written.append, warn=warned.append, moves=MoveOut())
    t = 0.0
    for i in range(12):
        slow = i >= 4  # 20 s at pace, then rank 2 at a quarter of its speed
        for r in range(4):
            steps = 5 if slow else 20
            s.add(r, _alive(steps, steps * (0.8 if slow and r == 2 else 0.2)), t)
        t += 5.0
        s.tick(t)
    assert len(warned) == 1 and "rank 2 computes 4.00x" in warned[0]
    assert s.baseline == 0.25  # 20 steps in 5 s before it slowed down
    dues = s.take_due()  # 8 windows slow: due from the 6th (30 s) on
    assert [(d.rank, d.held_s) for d in dues] == [(2, 30.0), (2, 35.0), (2, 40.0)]
    due = dues[-1]
    ev = s.moved(due, t)
    (mark,) = [w for w in written if isinstance(w, TimelineStraggler)]
    assert mark.rank == 2 and mark.moved is True
    assert mark.lost_s == 24.0  # 8 windows of 5 steps, each waiting 0.6 s more for rank 2
    assert ev is s.moves.moves[0]


def test_the_goodput_account_books_a_stragglers_pace():
    events = [decode(r) for r in (
        {"type": "timeline", "event": "start", "time": 0.0, "start": 1},
        {"type": "timeline", "event": "attempt", "time": 0.0, "attempt": 0},
        *({"type": "step", "time": float(t), "rank": 0, "step": t} for t in range(1, 101)),
        {"type": "timeline", "event": "straggler", "time": 80.0, "rank": 2, "since": 40.0, "lost_s": 30.0,
         "moved": True},
    )]
    g = account([e for e in events if e is not None], end=100.0)
    assert g.badput_s["straggler"] == 30.0 and g.productive_s == 99.0 - 30.0


def _live(ready: bool, shrink_floor: int = 0) -> LiveRecovery:
    pool = SparePool(0, start=lambda n, _env: None)
    if ready:
        pool.warm = lambda: object()  # a warm spare stands by (the pool's own process is not needed here)
    live = LiveRecovery(pool, budget=2, attempt=0, env_for=lambda *a: {}, numbered_from=0,
                        write_metric=lambda r: None, shrink_floor=shrink_floor, world_size=4)
    live.state = replace(live.state, able=dict.fromkeys(range(4)))
    return live


def _due(slowdown: float = 4.0, again: bool = False) -> Due:
    return Due(2, slowdown, 30.0, again, {"slowdown": slowdown, "held_s": 30.0, "step_s_before": 0.4,
                                          "compute_ms_before": {"0": 100.0, "2": 400.0}})


CPU2, GPU2 = DeviceSlot(2, "cpu", 2), DeviceSlot(2, "cuda", 2)


def test_moved_out_only_where_it_cannot_cost():
    survivors = [0, 1, 3]
    assert straggler_spare(_live(ready=True), CPU2, _due(), survivors).why_not is None
    assert "no warm spare" in straggler_spare(_live(ready=False), CPU2, _due(), survivors).why_not
    assert "own GPU, GPU2" in straggler_spare(_live(ready=True), GPU2, _due(), survivors).why_not
    assert straggler_spare(_live(ready=False, shrink_floor=2), GPU2, _due(), survivors).why_not is None
    assert "cost about as much" in straggler_spare(_live(ready=False, shrink_floor=2), CPU2, _due(1.8),
                                                   survivors).why_not
    assert "replacement is slow too" in straggler_spare(_live(ready=True), CPU2, _due(again=True), survivors).why_not
    assert straggler_spare(None, CPU2, _due(), survivors) is None
    shrunk = _live(ready=True, shrink_floor=2)
    # rank 1's data slot carried: its carrier computes two slots
    shrunk.state = replace(shrunk.state, carried={1: Carried(None)})
    assert "the group is shrunk" in straggler_spare(shrunk, CPU2, _due(), [0, 3]).why_not


def _view(now: float = 100.0) -> pol.View:
    return pol.View(now, tuple(pol.Rank(r, f"CPU{r}") for r in range(4)))


def test_the_policy_moves_it_out_with_a_spare_and_names_it_only_without():
    cause = straggler_cause(_due(), type("W", (), {"slot": CPU2})(), 2.0)
    s, actions = pol.decide(pol.State(), pol.StragglerFound(_view(), cause, pol.Spare(None)), RULES)
    assert [(a.ranks, a.signum) for a in actions if isinstance(a, pol.Send)] == [((2,), signal.SIGKILL)]
    assert dict(s.condemned)[2] is cause and s.cause is None and s.phase is pol.Phase.RUNNING
    assert [a.message for a in actions if isinstance(a, pol.Log)] == [
        f"{cause.message}; moved out live: SIGKILL to CPU2 (rank 2), a warm spare takes its rank and the device goes "
        "on the suspect list"]
    # its exit is a live recovery with the verdict as its cause, never the attempt's end
    s, actions = pol.decide(s, pol.Exited(_view(), 2, "CPU2", 137, "killed by SIGKILL", killed_by_us=True,
                                          spare=pol.Spare(None)), RULES)
    assert actions == [pol.ReplaceLive(2, cause)] and s.cause is None

    for spare, why in ((pol.Spare("no warm spare stands by yet"), "no warm spare stands by yet"),
                       (None, "live recovery is off in this attempt")):
        s, actions = pol.decide(pol.State(), pol.StragglerFound(_view(), cause, spare), RULES)
        assert not [a for a in actions if isinstance(a, pol.Send)] and s == pol.State()
        assert [a.message for a in actions if isinstance(a, pol.Log)] == [f"{cause.message}; not moved out: {why}"]


def test_no_move_out_while_anything_else_is_under_way():
    cause = straggler_cause(_due(), type("W", (), {"slot": CPU2})(), 2.0)
    failing = pol.State(cause=RootCause("worker-exit", 1, "rank 0 failed", rank=0))
    recovering = pol.State(condemned=((1, RootCause("hang", 124, "rank 1 hung", rank=1)),))
    for state in (failing, recovering, pol.State(phase=pol.Phase.STOPPING)):
        assert pol.decide(state, pol.StragglerFound(_view(), cause, pol.Spare(None)), RULES) == (state, [])


def test_a_stop_continue_cycle_faster_than_the_samples_is_no_stop_of_3_s():
    """A rank slowed by SIGSTOP/SIGCONT may be seen in state T at several samples in a row; its
    CPU time moved on between them, so it was not stopped all along (no hang verdict)."""
    tracker = ProcTracker()
    for i, cpu in enumerate((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7)):
        tracker.add([ProcSample(2, "T", cpu)], now=0.5 * i)
    assert tracker.state(2).since == 3.5
    stopped = ProcTracker()
    for i in range(8):
        stopped.add([ProcSample(2, "T", 1.0)], now=0.5 * i)
    assert stopped.state(2).since == 0.0
