"""Goodput accounting over made-up timelines: every cause against the timeline that made it.

One run goes through a restart, a live recovery, a SLURM requeue (a second start of the same
run) and a hang; each category is checked against the seconds the timeline was built with,
and the parts always add up to the wall time."""

from __future__ import annotations

import pytest

from supervisor.goodput import CAUSES, Goodput, account, console_line, decode
from supervisor.goodput.line import shares
from supervisor.goodput.timeline import decode_all


class Timeline:
    """Records as metrics.jsonl holds them, written along a clock that only moves forward."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.records: list[dict] = []

    def at(self, dt: float) -> float:
        self.t += dt
        return self.t

    def add(self, dt: float, **record) -> None:
        self.records.append({"time": self.at(dt), **record})

    def mark(self, dt: float, event: str, **fields) -> None:
        self.add(dt, type="timeline", event=event, **fields)

    def phase(self, dt: float, name: str, rank: int = 0) -> None:
        self.add(dt, type="phase", rank=rank, name=name)

    def steps(self, first: int, n: int, step_s: float = 0.1, rank: int = 0) -> None:
        for k in range(first, first + n):
            self.add(step_s, type="step", rank=rank, step=k)

    def startup(self, launch: float = 2.0, rendezvous: float = 0.5, init: float = 1.0, first_step: float = 0.7) -> None:
        self.phase(launch, "rendezvous")
        self.phase(rendezvous, "init")
        self.phase(init, "train")
        self.add(first_step, type="step", rank=0, step=-1)  # the first step: warm-up (compile)

    def first_attempt(self, steps: int, launch: float = 2.0) -> Timeline:
        """A run's first start and attempt, up to `steps` completed steps of 0.1 s."""
        self.mark(0, "start", start=0)
        self.mark(0.0, "attempt", attempt=0, resumed=False)
        self.startup(launch=launch)
        self.steps(0, steps)
        return self

    def account(self, end_dt: float = 0.0, since: float | None = None) -> Goodput:
        return account(decode_all(self.records), self.t + end_dt, since)


def _sums_to_wall(g: Goodput) -> None:
    assert set(g.badput_s) == set(CAUSES)
    assert round(g.productive_s + sum(g.badput_s.values()), 3) == g.wall_s
    assert g.ratio == pytest.approx(g.productive_s / g.wall_s, abs=1e-4)


def test_an_undisturbed_run_is_split_into_startup_steps_saves_and_eval():
    tl = Timeline()
    tl.mark(0, "start", start=0, dataset_s=1.5)
    tl.mark(3.0, "attempt", attempt=0, resumed=False)  # 1.5 s launch, then 1.5 s dataset build
    tl.startup()
    tl.steps(0, 20)
    tl.phase(0.0, "checkpoint")
    tl.phase(0.4, "train")
    tl.steps(20, 10)
    tl.phase(0.0, "eval")
    tl.phase(0.25, "train")
    tl.steps(30, 10)
    tl.phase(0.0, "shutdown")
    tl.mark(1.0, "attempt_end", attempt=0, outcome=None, failed_at=None)
    g = tl.account(end_dt=0.2)
    _sums_to_wall(g)
    b = g.badput_s
    assert b["dataset"] == 1.5 and b["launch"] == pytest.approx(1.5 + 2.0)
    assert b["rendezvous"] == 0.5 and b["warmup"] == pytest.approx(1.0 + 0.7)
    assert b["checkpoint_save"] == 0.4 and b["eval"] == 0.25
    assert g.productive_s == pytest.approx(4.0)  # 40 steps of 0.1 s
    assert b["other"] == pytest.approx(1.2)  # the interpreters' exit and the summary
    assert b["restart"] == b["redone"] == b["failure_detection"] == 0


def test_a_restart_a_live_recovery_a_requeue_and_a_hang_each_land_in_their_cause():
    tl = Timeline()
    # start 0, attempt 0: 30 steps, a save after step 19 (kept), a kill at step 29
    tl.mark(0, "start", start=0, dataset_s=None)
    tl.mark(1.0, "attempt", attempt=0, resumed=False)
    tl.startup()
    tl.steps(0, 20)
    tl.phase(0.0, "checkpoint")
    tl.phase(0.3, "train")
    tl.steps(20, 10)  # steps 20..29: 1.0 s trained again after the restart
    tl.mark(0.1, "attempt_end", attempt=0, outcome="worker-exit", failed_at=tl.t + 0.1)  # known 0.1 s after
    # the restart: 2 s of pause, teardown and spawn, resume (1 s), first step 0.7 s
    tl.mark(2.0, "attempt", attempt=1, resumed=True)
    tl.startup(launch=1.5, rendezvous=0.5, init=1.0, first_step=0.7)
    tl.steps(20, 20)
    tl.phase(0.0, "checkpoint")  # after step 39: kept
    tl.phase(0.3, "train")
    # a live recovery: rank 1 lost; 1.2 s to the rebuilt group's first step, 3 steps redone
    tl.add(1.2, type="recovery", rank=1, outcome="recovered", seconds=1.2, steps_redone=3)
    tl.steps(40, 10)
    # a hang: rank 1 stopped (state T) 0.5 s after step 49; the verdict 3.5 s later
    tl.mark(0.5, "proc", rank=1, state="T")
    verdict = tl.at(3.5)
    tl.mark(0.6, "attempt_end", attempt=1, outcome="hang", failed_at=verdict)
    before_requeue = tl.t
    # SLURM requeues the job: 100 s in the queue, then start 1 resumes from the save after step 39
    tl.t += 100.0
    tl.mark(0, "start", start=1, dataset_s=None)
    tl.mark(1.0, "attempt", attempt=0, resumed=True)
    tl.startup(launch=1.5, rendezvous=0.5, init=1.0, first_step=0.7)
    tl.steps(40, 20)
    tl.mark(0.5, "attempt_end", attempt=0, outcome=None, failed_at=None)
    g = tl.account()
    _sums_to_wall(g)
    b = g.badput_s
    assert g.wall_s == pytest.approx(tl.t - 1000.0 - 100.0)  # the time in the queue belongs to no start
    assert b["launch"] == pytest.approx(1.0 + 2.0) and b["rendezvous"] == 0.5 and b["warmup"] == pytest.approx(1.7)
    assert b["checkpoint_save"] == pytest.approx(0.3 + 0.3)
    assert b["checkpoint_restore"] == pytest.approx(2.0)  # init of each resumed attempt
    # kill: from the last step record to the exit seen; hang: from the last step to the verdict
    assert b["failure_detection"] == pytest.approx(0.1 + (0.5 + 3.5))
    # redone: steps 20..29 of attempt 0; 3 steps before the recovery's loss (37..39: the save between
    # is no step); the hang's steps 40..49, after attempt 1's save, which the requeued start trained again
    assert b["redone"] == pytest.approx(1.0 + 0.3 + 1.0)
    # restart: 2 s + the restarted attempt's launch, rendezvous and first step; the recovery's 1.2 s;
    # after the verdict 0.6 s; the requeued start's 1 s + launch, rendezvous, first step
    assert b["restart"] == pytest.approx((2.0 + 1.5 + 0.5 + 0.7) + 1.2 + 0.6 + (1.0 + 1.5 + 0.5 + 0.7))
    assert b["stopped"] == 0  # a stop that ended in a verdict is the hang's detection time
    assert g.productive_s == pytest.approx(2.0 + (2.0 - 0.3 + 1.0 - 1.0) + 2.0)
    assert before_requeue < tl.t


def test_a_stop_and_continue_is_stopped_time_and_the_run_goes_on():
    tl = Timeline().first_attempt(steps=10)
    tl.mark(0.05, "proc", rank=1, state="T")
    tl.mark(2.0, "proc", rank=1, state="S")
    tl.steps(10, 10)  # the step in flight through the stop completes 0.1 s after the continue
    g = tl.account()
    _sums_to_wall(g)
    assert g.badput_s["stopped"] == pytest.approx(2.0)
    assert g.productive_s == pytest.approx(1.0 + 0.05 + 1.0)


def test_an_asynchronous_save_still_in_flight_at_the_failure_is_not_kept():
    tl = Timeline().first_attempt(steps=10)
    tl.phase(0.0, "checkpoint")  # the snapshot of step 10; the write goes on in the background
    tl.phase(0.05, "train")
    tl.add(0.0, type="checkpoint", rank=0, step=5)  # an earlier save's record: kept up to step 4
    tl.steps(10, 5)
    failed = tl.at(0.01)
    tl.mark(0.0, "attempt_end", attempt=0, outcome="worker-exit", failed_at=failed)
    tl.mark(1.0, "attempt", attempt=1, resumed=True)
    tl.startup()
    tl.steps(5, 10)
    g = tl.account()
    _sums_to_wall(g)
    assert g.badput_s["redone"] == pytest.approx(1.0)  # steps 5..14: the step-10 write never completed


def test_a_window_counts_only_its_own_seconds():
    tl = Timeline().first_attempt(steps=100, launch=10.0)
    g = tl.account(since=tl.t - 5.0)
    assert g.wall_s == 5.0 and g.productive_s == 5.0 and g.ratio == 1.0


def test_records_of_the_wrong_shape_are_skipped_and_the_console_line_names_the_worst():
    assert decode({"type": "step", "time": "soon", "step": 3}) is None
    assert decode({"type": "timeline", "event": "attempt_end", "time": 5.0, "failed_at": "x"}).value is None
    assert decode(["not", "a", "record"]) is None
    g = Goodput(0.93, 100.0, 93.0, {**dict.fromkeys(CAUSES, 0.0), "restart": 3.0, "checkpoint_save": 1.0,
                                     "checkpoint_restore": 1.2, "launch": 1.3, "rendezvous": 0.5, "other": 0.2})
    assert console_line(g) == "goodput 0.93 (badput: 3% restarts, 2% checkpoints, 2% startup)"
    assert console_line(Goodput(1.0, 10.0, 10.0, dict.fromkeys(CAUSES, 0.0))) == "goodput 1.00"


def test_healing_a_silently_corrupted_replica_is_its_own_badput_cause():
    tl = Timeline().first_attempt(steps=5)
    tl.phase(0.05, "sdc")  # the check found a mismatch after step 4: naming and healing until step 5 completes
    tl.steps(5, 1, step_s=0.4)
    tl.steps(6, 3)
    g = tl.account()
    _sums_to_wall(g)
    assert g.badput_s["sdc"] == pytest.approx(0.4)
    assert dict(shares(g))["silent data corruption"] == pytest.approx(0.4 / g.wall_s)  # its own console group


def test_the_time_trained_shrunk_is_shown_apart_from_the_loss_to_the_regrow_and_stays_productive():
    tl = Timeline().first_attempt(steps=10)
    tl.add(0.8, type="recovery", rank=2, outcome="recovered", action="shrink", seconds=0.8, steps_redone=0)
    tl.steps(10, 30)  # 3 s shrunk (the loss was 0.8 s before the shrink's record)
    tl.phase(0.0, "rendezvous")  # the regrow's pause: the leader rebuilds the group with the newcomer
    tl.phase(0.3, "train")
    tl.add(0.1, type="recovery", rank=2, outcome="recovered", action="regrow", seconds=0.4, steps_redone=0)
    tl.steps(40, 10)
    g = tl.account()
    _sums_to_wall(g)
    assert g.shrunk_s == pytest.approx(0.8 + 3.0 + 0.0, abs=1e-6)  # the loss -> the regrow's decision
    # the shrink's loss -> its first step is a restart; the regrow lost nothing: its pause is the rendezvous
    assert g.badput_s["restart"] == pytest.approx(0.8) and g.badput_s["rendezvous"] == pytest.approx(0.5 + 0.3)
    plain = Timeline().first_attempt(steps=10)
    plain.steps(10, 30)
    assert plain.account().shrunk_s == 0.0
    assert "trained shrunk" in console_line(g) and "shrunk" not in console_line(plain.account())


def test_a_shrink_that_lost_rank_0_follows_its_lowest_survivor_until_the_regrow_brings_rank_0_back():
    tl = Timeline().first_attempt(steps=10)
    tl.add(0.8, type="recovery", rank=0, outcome="recovered", action="shrink", seconds=0.8, steps_redone=0)
    tl.steps(10, 30, rank=1)  # rank 1 leads the shrunk group: 3 s trained without rank 0
    tl.phase(0.0, "rendezvous", rank=0)  # the newcomer taking rank 0 back joins and builds its trainer...
    tl.phase(0.1, "init", rank=0)
    tl.phase(0.0, "rendezvous", rank=1)  # ...while the group trains on, up to the boundary where it rebuilds
    tl.phase(0.3, "train", rank=1)
    tl.add(0.1, type="recovery", rank=0, outcome="recovered", action="regrow", seconds=0.5, steps_redone=0)
    tl.steps(40, 10, rank=0)
    g = tl.account()
    _sums_to_wall(g)
    # as when rank 2 is the one lost: the loss to the first step restart, the regrow's pause the
    # leader's rendezvous, the shrunk stretch productive; the newcomer's own start is no warm-up
    assert g.badput_s["restart"] == pytest.approx(0.8) and g.badput_s["rendezvous"] == pytest.approx(0.5 + 0.3)
    assert g.badput_s["warmup"] == pytest.approx(1.0 + 0.7) and g.badput_s["other"] == 0
    assert g.shrunk_s == pytest.approx(0.8 + 3.0, abs=1e-6)  # the loss -> the regrow's decision
    never_back = Timeline().first_attempt(steps=5)
    never_back.add(0.5, type="recovery", rank=0, outcome="recovered", action="shrink", seconds=0.5, steps_redone=0)
    never_back.steps(5, 20, rank=1)
    g = never_back.account(end_dt=0.0)
    assert g.badput_s["other"] == 0 and g.productive_s == pytest.approx(0.1 * (5 + 20), abs=1e-6)  # every step


def test_a_shrink_never_grown_back_counts_to_the_attempts_end():
    tl = Timeline().first_attempt(steps=5)
    tl.add(0.5, type="recovery", rank=3, outcome="recovered", action="shrink", seconds=0.5, steps_redone=0)
    tl.steps(5, 20)
    assert tl.account(end_dt=1.0).shrunk_s == pytest.approx(0.5 + 2.0 + 1.0, abs=1e-6)


def test_painting_an_attempts_loop_in_one_pass_equals_painting_it_piece_by_piece():
    import random

    from supervisor.goodput.account import paint, paint_tiles

    rng = random.Random(7)
    labels = ("productive", "warmup", "checkpoint_save", "other")
    for _ in range(200):
        base = [[0.0, 10.0, "other"]]
        for _ in range(rng.randrange(4)):  # what earlier paints left: segments of several labels
            a = rng.uniform(0, 10)
            paint(base, a, a + rng.uniform(0, 3), rng.choice(labels))
        cuts = sorted(rng.uniform(-1, 11) for _ in range(rng.randrange(1, 12)))
        tiles = [[a, b, rng.choice(labels)] for a, b in zip(cuts, cuts[1:])]  # contiguous, as a loop's are
        one_by_one, at_once = [list(s) for s in base], [list(s) for s in base]
        for a, b, label in tiles:
            paint(one_by_one, a, b, label)
        paint_tiles(at_once, tiles)
        assert at_once == one_by_one, (base, tiles)


def test_a_long_script_run_is_accounted_in_seconds_not_hours():
    """A script's heartbeats come twice a second per rank: seven hours are 50k records of its
    leader alone. Painted one at a time that was quadratic: the run's end, and each restart,
    waited tens of minutes on it."""
    import time

    line = Timeline().first_attempt(50_000)
    events = decode_all(line.records)
    started = time.monotonic()
    g = account(events, line.t + 1.0)
    assert time.monotonic() - started < 15  # linear: a fraction of a second; quadratic: tens of minutes
    _sums_to_wall(g)
    assert g.productive_s == pytest.approx(0.1 * 50_000, abs=0.01)


def test_the_timeline_reader_decodes_only_what_was_appended_and_never_half_a_line(tmp_path):
    import orjson

    from supervisor.goodput import TimelineReader, read_events

    path = tmp_path / "metrics.jsonl"
    line = Timeline().first_attempt(3)
    lines = [orjson.dumps(r) for r in line.records]
    alive = orjson.dumps({"type": "alive", "rank": 0, "time": 1.0, "phase": "step"})
    path.write_bytes(b"\n".join([lines[0], alive, *lines[1:4]]) + b"\n" + lines[4][:7])  # the last one mid-write
    reader = TimelineReader(path)
    reader.CHUNK = 16  # lines span chunks
    assert [e.kind for e in reader.events()] == ["start", "attempt", "phase", "phase"]
    with path.open("ab") as f:
        f.write(lines[4][7:] + b"\n" + b"\n".join(lines[5:]) + b"\n")
    assert reader.events() == read_events(path) == decode_all(line.records)
    path.write_bytes(lines[0] + b"\n")  # another file at the same path (shorter): read from its start
    assert [e.kind for e in reader.events()] == ["start"]


@pytest.mark.integration
def test_a_starts_mark_is_when_its_process_was_created_to_a_clock_tick():
    """The launcher's own start (its interpreter and imports are launch time); psutil's
    create_time, off by up to a second (the boot time in whole seconds), made a start longer or
    shorter than it was."""
    import subprocess
    import sys
    import time

    from tests.supervisor.helpers import env

    code = ("import time; time.sleep(0.5); from supervisor.goodput import marks; "
            "print(marks.start(0, time.monotonic(), None).time)")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, text=True, timeout=60)
    after = time.time()
    created = float(out.stdout)
    assert before - 0.02 <= created <= after - 0.5  # a clock tick before: the kernel counts whole ticks


def _script_until_killed(tl: Timeline, saved_after: int = 40, more: int = 5) -> None:
    """A --script's attempt 0: silent until its first optimizer step, steps of 0.1 s, a torch.save
    of 0.2 s after step `saved_after` seen by the bootstrap, `more` steps after it."""
    tl.mark(0, "start", start=0)
    tl.mark(0.0, "attempt", attempt=0, resumed=False, script=True)
    tl.add(3.0, type="step", rank=0, step=1)  # imports, rendezvous, the first step: launch
    tl.steps(2, saved_after - 1)
    tl.phase(0.0, "checkpoint")
    tl.add(0.2, type="script_save", rank=0, step=saved_after, path="/ck/last.pt", api="torch.save", seconds=0.2)
    tl.phase(0.0, "train")
    tl.steps(saved_after + 1, more)


def test_a_scripts_steps_after_its_last_save_are_redone_at_a_restart():
    tl = Timeline()
    _script_until_killed(tl)
    tl.mark(0.1, "attempt_end", attempt=0, outcome="worker-exit", failed_at=tl.t + 0.05)
    tl.mark(1.0, "attempt", attempt=1, resumed=False, script=True)
    tl.add(2.0, type="step", rank=0, step=1)
    tl.steps(2, 10)
    tl.mark(0.1, "attempt_end", attempt=1, outcome=None, failed_at=None)
    g = tl.account()
    _sums_to_wall(g)
    b = g.badput_s
    assert b["redone"] == pytest.approx(0.5)  # steps 41..45: after the save, trained again
    assert b["checkpoint_save"] == pytest.approx(0.2) and b["failure_detection"] == pytest.approx(0.05)
    assert g.productive_s == pytest.approx(3.9 + 1.0)  # steps 2..40 of attempt 0, 2..11 of attempt 1


@pytest.mark.parametrize("saved_after_the_signal", [False, True])
def test_a_script_stopped_loses_its_steps_after_its_last_save(saved_after_the_signal):
    """Ctrl-C: gpuherd saves nothing for a script. Its steps after the last save it saw are not
    productive (nothing kept them), unless the script saved on its way out."""
    tl = Timeline()
    _script_until_killed(tl)
    if saved_after_the_signal:
        tl.add(0.3, type="script_save", rank=0, step=45, path="/ck/last.pt", api="torch.save", seconds=0.25)
    tl.mark(0.5, "attempt_end", attempt=0, outcome="interrupted", failed_at=None)
    g = tl.account()
    _sums_to_wall(g)
    assert g.badput_s["redone"] == pytest.approx(0.0 if saved_after_the_signal else 0.5)
    assert g.productive_s == pytest.approx(3.9 + (0.5 if saved_after_the_signal else 0.0))
    assert g.badput_s["failure_detection"] == 0  # a stop asked for: nothing to detect


def test_a_built_in_trainers_stop_keeps_its_steps():
    """Its own worker saves at the stop (the `checkpoint` record): nothing lost."""
    tl = Timeline().first_attempt(steps=10)
    tl.mark(0.5, "attempt_end", attempt=0, outcome="interrupted", failed_at=None)
    assert tl.account().badput_s["redone"] == 0


def test_a_script_that_crashed_before_its_first_step_is_all_launch_not_failure_detection():
    """Its exit was seen at once: the seconds before it were imports and start-up."""
    tl = Timeline()
    tl.mark(0, "start", start=0)
    tl.mark(0.5, "attempt", attempt=0, resumed=False, script=True)
    failed = tl.at(5.0)
    tl.mark(0.02, "attempt_end", attempt=0, outcome="worker-exit", failed_at=failed)
    g = tl.account()
    _sums_to_wall(g)
    assert g.badput_s["failure_detection"] == 0
    assert g.badput_s["launch"] == pytest.approx(5.5 + 0.02)  # its teardown too: it never said a word
