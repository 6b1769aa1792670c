"""Status records -> per-rank progress and liveness: hangs, early exits, a process group that never forms.

Per rank, two clocks. *Liveness*: any record (gpuherd/liveness.py's `alive` records
come every second from a thread of their own, whatever the loop does). *Progress*: a
new step, phase, eval or checkpoint: an `alive` record counts only when its (phase,
step) changed (its `for_s` dates the change), any other record always (a script
without liveness records says nothing else). A rank without progress for longer than
its phase's allowance (timeouts.py: learned per phase, startup phases get the startup
allowance) triggers the hang verdict; evidence.py decides whom to blame, with the
kernel's view of every worker: the /proc samples `check` is given (proc_state.py; the
supervision loop reads them), so a verdict is a function of its inputs and a test can
write them by hand. Records come decoded (gpuherd/status_records.py) and are matched by type. While a rank saves a checkpoint, the
ranks that may be waiting for it in a collective get the checkpoint allowance too.
Ranks that never write a record (a script that steps no torch optimizer, or runs with
`--no-auto-heartbeat` and no status records) are judged only when the run expects
records (built-in workers always send them); the supervisor is told once
(`newly_unwatched`) so it can say so. One the kernel shows unable to run (state T, t or D)
is judged all the same, its startup allowance counted from when it was first seen so: an
attempt whose ranks were all stopped before their first record (a restart handed to stopped
standbys) waited forever, unsaid. Every rank seen stopped (state T) for DECISIVE_STOP_S is said
once, with when a verdict comes if none runs again: a pause someone made is judged by the
allowances, never in silence.

Silence counts only while the supervisor itself runs: after it was stopped (Ctrl-Z,
SIGSTOP, a frozen VM) the clocks restart from the moment it resumed
(`restart_clocks`), so records that sat unread in the pipes meanwhile never make a
healthy worker look hung.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuherd.status_records import (Alive, Checkpoint, CheckpointWrite, Done, Error, Eval, Nan, Phase, Record,
                                    Step)
from supervisor.goodput import marks
from supervisor.health import evidence as ev
from supervisor.health.proc_state import CANNOT_RUN, ProcSample, ProcState, ProcTracker
from supervisor.health.stragglers import Stragglers
from supervisor.health.timeouts import LearnedTimeouts

# shutdown: the program is done and the interpreter tears down (process groups, CUDA, a big
# model's garbage), which can take longer than a training step: it gets the startup allowance
STARTUP_PHASES = ("init", "rendezvous", "compile", "shutdown")
# Initial step allowance (until steps are timed) when system.hang_timeout is 0: a production
# step plus its logging can take minutes on one GPU; a --script's steps are unknown.
HANG_DEFAULTS = {"debug": 60.0, "gpt2-small": 300.0, "production": 600.0}
SCRIPT_HANG_DEFAULT = 300.0


def hang_timeouts(preset: str, hang_timeout: float, startup_timeout: float, script: bool) -> tuple[float, float]:
    """(initial step allowance, startup allowance) seconds for this run."""
    hang = hang_timeout or (SCRIPT_HANG_DEFAULT if script else HANG_DEFAULTS.get(preset, 600.0))
    startup = startup_timeout or max(3 * hang, 300.0)
    return hang, startup


def timed_phase(phase: str | None, step: int | None) -> str:
    """The phase whose allowance applies: step | eval | checkpoint | startup."""
    if phase in ("eval", "checkpoint"):
        return phase
    if step is None or phase in STARTUP_PHASES:
        return "startup"
    return "step"


@dataclass
class RankState:
    rank: int
    spawned: float
    last_record: float | None = None
    records: int = 0
    phase: str | None = None
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    done: bool = False
    joined: bool = False  # past process-group init (any record that only a joined rank sends)
    error: str | None = None
    progress_at: float | None = None  # when it last moved on
    progress_key: tuple | None = None  # (phase, step) of its last `alive` record
    timed: str = "startup"  # the phase its allowance comes from
    live: Alive | None = None  # its last `alive` record
    live_at: float | None = None
    unwatched_told: bool = False  # the supervisor said this rank is not judged by heartbeat
    saving: bool = False  # in phase checkpoint, its `checkpoint` record not sent yet
    save_ended: float | None = None  # when its last save ended (record or next phase)
    saved_at: float | None = None  # when its last `checkpoint` record came
    writing: str | None = None  # the checkpoint its writer thread is writing in the background

    def describe(self) -> str:
        if self.records == 0:
            return "never sent a status record"
        parts = [f"step {self.step}" if self.step is not None else "no step yet"]
        if self.phase:
            parts.append(f"phase {self.phase}")
        return ", ".join(parts)


@dataclass(frozen=True)
class HangVerdict:
    kind: str  # "hang" | "rendezvous"
    rank: int  # the rank blamed first
    message: str
    evidence: tuple[str, ...] = ()  # one line per rank, blamed ranks first


class Heartbeats:
    def __init__(self, ranks: list[int], now: float, timeouts: LearnedTimeouts, rendezvous: float,
                 expect_heartbeats: bool, stragglers: Stragglers | None = None,
                 write_metric: Callable[[Record], None] | None = None) -> None:
        """`write_metric`: where a rank seen stopped (state T) or running again is recorded (goodput)."""
        self.ranks = {r: RankState(r, now) for r in ranks}
        self.timeouts, self.rendezvous = timeouts, rendezvous
        self.expect = expect_heartbeats
        self.stragglers = stragglers
        self.write_metric = write_metric
        self.procs = ProcTracker()  # the kernel's view, from the samples `check` is given
        self._rendezvous_started: float | None = None
        self._clock_floor = now  # no silence counts from before this (restart_clocks)
        self.notices: list[str] = []  # INFO lines for the supervisor to say (taken by it)
        self._told_working: set[tuple[int, float]] = set()
        self._told_stopped: set[tuple[float, ...]] = set()

    def rejoin(self, rank: int, now: float) -> None:
        """A warm spare took `rank` (live recovery): judged afresh (its process too: the samples
        of the lost one are forgotten), and the rebuilt group gets a whole rendezvous allowance
        from the survivors' first `rendezvous` phase on."""
        self.ranks[rank] = RankState(rank, now)
        self.procs.forget(rank)
        self._rendezvous_started = None

    def record(self, rank: int, rec: Record, now: float) -> None:
        st = self.ranks.get(rank)
        if st is None:
            return
        st.last_record, st.records = now, st.records + 1
        if isinstance(rec, Alive):
            self._alive(st, rec, now)
            return
        if isinstance(rec, (Phase, Checkpoint, CheckpointWrite)):
            self._track_save(st, rec, now)
        self._status(st, rec, now)
        st.progress_at = now
        st.timed = timed_phase(st.phase, st.step)

    def _status(self, st: RankState, rec: Record, now: float) -> None:
        if st.phase == "rendezvous":  # anything a rank says after entering rendezvous means it got through
            st.joined = True
        match rec:
            case Phase(name=name):
                st.phase = str(name)
                if st.phase == "rendezvous":
                    st.joined = False
                    if self._rendezvous_started is None:
                        self._rendezvous_started = now
            case Step():
                # Step records alone teach the timeouts nothing: between two of them a script may
                # evaluate, save or reshuffle for minutes unannounced; `alive` records name the phase.
                st.step, st.max_steps, st.loss = rec.step, rec.max_steps, rec.loss
                if self.stragglers is not None and rec.steps and rec.compute_s is not None:
                    self.stragglers.add(st.rank, rec, now)  # a script's live session times its steps
                st.joined = True
                if st.phase in ("init", "rendezvous", None):
                    st.phase = "train"
            case Eval(step=step) | Checkpoint(step=step) | Nan(step=step):
                st.joined = True
                if step is not None:
                    st.step = step
            case Done(step=step):
                st.done = st.joined = True
                if step is not None:
                    st.step = step
            case Error(message=message):
                st.error = str(message)
        if self._rendezvous_started is not None and all(s.joined for s in self.ranks.values()):
            # formed: a group rebuilt later (another node's recovery, a regrow, none of which
            # promotes a spare here) gets a whole allowance from its own first `rendezvous`
            self._rendezvous_started = None

    def _alive(self, st: RankState, rec: Alive, now: float) -> None:
        """A liveness record: progress only if the loop moved on; what it timed is learned."""
        st.live, st.live_at = rec, now
        for phase, (count, longest) in rec.took.items():
            self.timeouts.observe(phase, longest, count)
        if self.stragglers is not None and rec.steps and rec.compute_s is not None:
            self.stragglers.add(st.rank, rec, now)
        phase, step = rec.phase, rec.step
        if step is not None and (not isinstance(st.step, int) or step > st.step):
            st.step = step  # steps reached, between the (rarer) step records
        if step is None and phase not in STARTUP_PHASES:  # nothing to measure progress by: a heartbeat
            st.progress_at, st.timed = now, "startup"
            return
        if (phase, step) != st.progress_key:
            st.progress_key = (phase, step)
            st.progress_at = max(st.spawned, now - rec.for_s)
            st.timed = timed_phase(phase, step)

    @staticmethod
    def _track_save(st: RankState, rec: Phase | Checkpoint | CheckpointWrite, now: float) -> None:
        if isinstance(rec, CheckpointWrite):  # a background write started, or failed
            if rec.state in ("started", "failed"):  # `accounted` says what a save cost, not that its write ended
                st.writing = str(rec.path) if rec.state == "started" else None
            return
        if isinstance(rec, Checkpoint):
            st.writing = None
        starts = isinstance(rec, Phase) and rec.name == "checkpoint"
        if st.saving and not starts:
            st.saving, st.save_ended = False, now
        if starts:
            st.saving = True
        if isinstance(rec, Checkpoint):
            st.saved_at = now

    def longest_step(self) -> float | None:
        """The longest step seen so far (a graceful stop waits for the step in flight)."""
        return self.timeouts.longest("step")

    def restart_clocks(self, now: float) -> None:
        """The supervisor was not running until `now`: start every silence from here."""
        self._clock_floor = max(self._clock_floor, now)

    def _since(self, st: RankState) -> float:
        """When its current stretch without progress began (for the verdict's clock); for a rank
        judged only because it cannot run (no record, none expected), when it was first seen so."""
        start = st.progress_at or st.spawned
        if not self.expect and not st.records and (stuck := self._stuck(st.rank)) is not None:
            start = max(start, stuck.since)
        return max(start, self._clock_floor)

    def _stuck(self, rank: int) -> ProcState | None:
        """Its process's state where the kernel shows it unable to run (T, t, D), else None."""
        proc = self.procs.state(rank)
        return proc if proc is not None and proc.letter in CANNOT_RUN else None

    def _tell_all_stopped(self, running: list[RankState], watched: list[RankState], saving: bool, now: float) -> None:
        """Once per stretch: every running rank stopped (state T) for DECISIVE_STOP_S, and when the
        allowances give a verdict if none runs again (the decisive rules leave a whole job stopped be)."""
        procs = [self.procs.state(st.rank) for st in running]
        if not running or not all(p is not None and p.letter == "T"
                                  and p.held(now, self._clock_floor) >= ev.DECISIVE_STOP_S for p in procs):
            return
        key = tuple(p.since for p in procs if p is not None)
        if key in self._told_stopped or not watched:
            return
        self._told_stopped.add(key)
        due = min(self._since(st) + self.allowance(st, saving) for st in watched) - now
        names = ", ".join(f"rank {st.rank}" + ("" if st.records else " (no record yet)") for st in running)
        self.notices.append(f"every running rank is stopped (state T): {names}; taken for a pause someone made "
                            f"(Ctrl-Z, a cgroup freezer): a verdict in {max(due, 0.0):.0f} s at the latest unless one runs again")

    def stop_due(self) -> float | None:
        """When a rank seen stopped (state T) will have held it DECISIVE_STOP_S, if no sample has
        shown it that long yet: the /proc read the decisive rule needs is due then, not at the next
        regular read (up to PROC_SAMPLE_S later). None: no such rank."""
        due = []
        for rank in self.ranks:
            proc = self.procs.state(rank)
            if proc is not None and proc.letter == "T":
                at = max(proc.since, self._clock_floor) + ev.DECISIVE_STOP_S
                if proc.seen is None or proc.seen < at:
                    due.append(at)
        return min(due, default=None)

    def responsive(self, now: float, alive: set[int]) -> set[int]:
        """Ranks whose liveness thread still reports and whose process is not frozen: they can answer
        a request (a rank in state D too: only its main thread sleeps)."""
        return {r for r in alive if (st := self.ranks.get(r)) is not None and st.live_at is not None
                and now - st.live_at <= ev.LIVENESS_SILENT_S
                and not ((proc := self.procs.state(r)) is not None and proc.frozen)}

    def allowance(self, st: RankState, saving: bool = False) -> float:
        """`saving`: another rank is in phase checkpoint (this one may be waiting for it)."""
        own = self.timeouts.allowance(st.timed)
        return max(own, self.timeouts.allowance("checkpoint")) if saving else own

    def check(self, now: float, alive: set[int], samples: Iterable[ProcSample] = ()) -> HangVerdict | None:
        """A hang or a failed rendezvous among the ranks still running, or None. `samples`: the
        kernel's view of the workers read since the last check (proc_state.read), the only
        /proc the verdict knows: it reads nothing itself."""
        for rank, letter in self.procs.add(samples, now):
            if self.write_metric is not None:
                self.write_metric(marks.proc(rank, letter, now))
        if self.stragglers is not None:
            self.stragglers.tick(now)
        running = [st for st in self.ranks.values() if st.rank in alive and not st.done]
        if len(running) > 1:  # a hang beyond doubt needs no allowance (evidence.decisive)
            views = self._views(running, now)
            hung, why = ev.decisive(views, now, self._clock_floor)
            if hung:
                return self._hang([self.ranks[r] for r in hung], views, now, decided=why)
        watched = [st for r, st in self.ranks.items()
                   if r in alive and not st.done and (self.expect or st.records or self._stuck(r) is not None)]
        started = self._rendezvous_started
        if started is not None and now - max(started, self._clock_floor) > self.rendezvous:
            missing = [st for st in self.ranks.values() if st.rank in alive and not st.joined]
            if missing:
                names = ", ".join(f"rank {st.rank} ({st.describe()})" for st in missing)
                return HangVerdict("rendezvous", missing[0].rank,
                               f"process group not formed after {self.rendezvous:.0f} s: {names} never joined")
        saving = any(st.phase == "checkpoint" for st in watched)
        self._tell_all_stopped(running, watched, saving, now)
        stale = [st for st in watched if now - self._since(st) > self.allowance(st, saving)]
        if not stale:
            return None
        views = self._views(running, now)
        # working ranks are let be up to the startup allowance (a compile, a first step): a rank
        # spinning in a collective nothing marks (a GPU syncing) looks busy too, so never forever
        limit = max(self.timeouts.allowance("startup"), max(self.allowance(st, saving) for st in stale))
        working = {r: why for r, why in ev.progressing(views).items()
                   if now - self._since(self.ranks[r]) <= limit}
        self._tell_working([st for st in stale if st.rank in working], working, now, limit)
        stale = [st for st in stale if st.rank not in working]
        if not stale:
            return None  # past the allowance but computing: slow, not hung (a verdict needs evidence)
        return self._hang(stale, views, now)

    def _tell_working(self, stale: list[RankState], working: dict[int, str], now: float, limit: float) -> None:
        """Once per stretch without progress: a rank past its allowance is let be, and why."""
        for st in stale:
            key = (st.rank, self._since(st))
            if key in self._told_working:
                continue
            self._told_working.add(key)
            self.notices.append(
                f"rank {st.rank}: no new step for {now - self._since(st):.0f} s, past its allowance "
                f"({self.timeouts.explain(st.timed)}), but it is working, not hung: {working[st.rank]}; waiting on, "
                f"up to {limit:.0f} s without a new step (the startup allowance)")

    def newly_unwatched(self, now: float, alive: set[int]) -> list[int]:
        """Ranks still running past the startup allowance without a single record, each
        returned once: nothing judges them by heartbeat, and the user should know."""
        if self.expect:
            return []
        startup = self.timeouts.allowance("startup")
        due = [st for st in self.ranks.values() if st.rank in alive and not st.records and not st.unwatched_told
               and now - st.spawned > startup]
        for st in due:
            st.unwatched_told = True
        return [st.rank for st in due]

    def _views(self, running: list[RankState], now: float) -> list[ev.RankSnapshot]:
        return [ev.RankSnapshot(st.rank, st.step, now - (st.last_record or st.spawned), st.live,
                            None if st.live_at is None else now - st.live_at, st.live_at == st.last_record,
                            self.procs.state(st.rank), announced=st.phase)
                for st in running]

    def _hang(self, stale: list[RankState], views: list[ev.RankSnapshot], now: float,
              decided: str = "") -> HangVerdict:
        """`decided`: why the evidence alone decided it (no allowance was waited for)."""
        found = [ev.judge(v, now) for v in views]
        stalled = {st.rank: now - self._since(st) for st in stale}
        blamed, why = ev.blame(found, stalled)
        first = self.ranks[blamed[0]]
        lines = ev.ordered_lines(found, blamed)
        waited = (f"decided without waiting for an allowance: {decided}" if decided
                  else self.timeouts.explain(first.timed))
        message = (f"hang: {', '.join(f'rank {r}' for r in blamed)} ({why}): "
                   + "; ".join(lines[:len(blamed)])
                   + f"; no progress for {now - self._since(first):.0f} s, "
                   f"{waited}; steps reached: {self.steps_reached()}")
        return HangVerdict("hang", blamed[0], message, tuple(lines))

    def steps_reached(self) -> str:
        return ", ".join(f"rank {st.rank}={st.step if st.step is not None else '-'}" for st in self.ranks.values())
