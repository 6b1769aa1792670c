"""The supervision policy: what an attempt does next, as a pure function of events and time.

`decide(state, event, rules) -> (state, actions)`. The state is one immutable record
(`State`: the phase, its deadline, the root cause, the signals counted so far, the graceful
stop and the early exit under way); an event brings the moment and what the loop knows of
the live ranks (`View`), and a lost or hung rank's event whether a warm spare can take it
(`Spare`); actions say what to do (`Send` signals, `Log`, `Note`, `Publish` the root cause,
ask for collective traces, `ReplaceLive` a lost rank). The root cause is immutable: what the
loop learns later (the traces read, the cause as published, the drained stderr tail, a
replacement that failed) comes back as an event. No pipe, pid or clock here: supervision.py
reads the pipes, reaps, turns what it saw into events and carries the actions out, and
tests/supervisor/test_policy.py drives every transition with synthetic events in
milliseconds. The phases (docs/design/supervision.md):

    RUNNING --a rank exits 0 early--> FINISHING --the others stop progressing--> DUMPING_TRACES
    RUNNING/FINISHING --hang verdict--> DUMPING_TRACES --every responsive rank dumped its
        collective trace, or TRACES_WAIT--> DUMPING_STACKS --stacks written--> TERMINATING
        (at the verdict a stopped hung rank is SIGKILLed, and the stacks are asked for, at
        once: the evidence is gathered in parallel and never waited for from a rank that
        cannot answer; at TERMINATING the hung rank gets SIGKILL, not the teardown signal)
    any live phase --failure, watcher, node lost, SIGQUIT--> TERMINATING --grace over--> KILLING
    RUNNING --Ctrl-C--> STOPPING (workers save, exit 130) --grace over, no rank still in its
        step or saving--> KILLING
    RUNNING --SIGTERM/SIGHUP/SIGUSR1/SIGUSR2--> STOPPING (save, exit 143) --stop timeout--> KILLING
        (a --script: TERMINATING with the stop timeout; SIGUSR1/2 are forwarded to it instead)
    RUNNING --a stop signal that reached a worker itself (its `stop` record)--> STOPPING, as if
        the supervisor had received it (SLURM signals every process of a step)
    any --Ctrl-C again / SIGTERM again / SIGQUIT again--> KILLING --KILL_WAIT--> DONE
    any --no worker left--> DRAINING --pipes closed or DRAIN_WAIT--> DONE
    RUNNING/FINISHING --a rank a warm spare can take fails--> (no phase change) ReplaceLive; a hang
        verdict on one: SIGKILL to it, its verdict kept as the cause of its exit (live recovery)
    RUNNING --a straggler slower than the set factor for the set time, a warm spare free--> (no phase
        change) SIGKILL to it, its verdict kept as the cause of its exit (moved out live); no spare:
        named only, and why
    RUNNING --a warm spare can take back a shrunk group's carried rank--> (no phase change) Regrow;
        in any other phase (a stop, a teardown, a rank finishing early) or with a hung rank being
        killed for a recovery, nothing: the spare waits

A teardown only ever moves to a harsher phase (`_escalate`). The event vocabulary is open:
a new cause of teardown (a node lost, a planned stop by the scheduler, a spare ready) is
one more event class and one more entry in `_HANDLERS`.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field, replace

from gpuherd.exit_codes import ExitCode
from supervisor.processes.stopping import GracefulStop, stop_exit_code
from supervisor.summary import RootCause

STACK_DUMP_WAIT = 0.25  # after the stacks signal: faulthandler writes them from its signal handler at once
KILL_WAIT = 10.0  # after SIGKILL: a process in uninterruptible sleep (a wedged driver) may linger
DRAIN_WAIT = 2.0  # after the last worker: pipes a setsid'd grandchild still holds are given up
EARLY_EXIT_NOTICE = 2.0  # a rank exited 0 and the others still run this much later: say so (INFO)
TRACES_WAIT = 3.0  # a hang: how long the responsive ranks get to dump their collective traces
STEP_MARGIN = 1.5  # Ctrl-C: the step in flight may take this much longer than the longest seen


class Phase(enum.Enum):
    RUNNING = "running"  # judging heartbeats; no deadline
    FINISHING = "finishing"  # a rank exited 0 early: the others end at their pace while they progress
    DUMPING_TRACES = "dumping traces"  # hang verdict: collective traces requested; stacks at the deadline
    STOPPING = "stopping"  # graceful stop (Ctrl-C, SIGTERM): workers save and exit; SIGKILL at the deadline
    DUMPING_STACKS = "dumping stacks"  # hang verdict: the stacks signal sent; teardown at the deadline
    TERMINATING = "terminating"  # the teardown signal sent to every group; SIGKILL at the deadline
    KILLING = "killing"  # SIGKILL sent; given up at the deadline (a process in uninterruptible sleep)
    DRAINING = "draining"  # no worker left; reading what is still in the pipes
    DONE = "done"


# Phases from which the policy only moves on (a teardown never goes back to a gentler signal).
_TEARDOWN_ORDER = [Phase.DUMPING_TRACES, Phase.DUMPING_STACKS, Phase.STOPPING, Phase.TERMINATING, Phase.KILLING,
                   Phase.DRAINING, Phase.DONE]


# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Rules:
    """Fixed for an attempt."""

    grace: float  # teardown: SIGTERM -> SIGKILL; Ctrl-C: the time to reach a save (plus the step in flight)
    stop_timeout: float  # a graceful stop, saves included, never takes longer
    save_signal: int | None  # gpuherd's worker: SIGUSR2 = save and stop; None: a --script
    finish_window: float  # after a clean early exit: how long the others may go without progress
    traces: bool = True  # hang verdicts ask for collective traces first
    teardown_signal: int = signal.SIGTERM  # "exit now" (gpuherd's worker: contract.TEARDOWN_SIGNAL)
    stacks_signal: int = signal.SIGUSR1  # "dump your stacks" (gpuherd's worker: contract.STACKS_SIGNAL)


@dataclass(frozen=True)
class Rank:
    """What the loop knows of one live worker."""

    rank: int
    tag: str  # CPU0 / GPU3
    handles: frozenset[int] = frozenset()  # of the stacks signal, SIGUSR1 and SIGUSR2 (a save): those it caught
    saving: bool = False  # phase checkpoint
    writing: str | None = None  # a checkpoint its writer thread still writes in the background (its path)
    in_step: bool = False  # inside a training step (a graceful stop waits for its boundary)
    leaving: bool = False  # said `shutdown`: on its way out after its save
    save_ended: float | None = None  # its last save's end
    heard: bool = True  # sent a record, or none are expected of it


@dataclass(frozen=True)
class View:
    now: float
    alive: tuple[Rank, ...] = ()
    step_s: float | None = None  # the longest step seen (None: not timed yet)


@dataclass(frozen=True)
class Spare:
    """Live recovery's answer for a lost rank, at the moment of the event (live_recovery.py's
    `why_not`, asked by the loop with the other live ranks as the survivors)."""

    why_not: str | None = None  # None: a warm spare can take the rank now; else why not, in words


@dataclass(frozen=True)
class Moment:
    """An event that brings nothing but the moment and the view."""

    view: View


class Tick(Moment):
    """Time passed: a deadline may be over."""


@dataclass(frozen=True)
class Exited:
    """A worker ended (already reaped: it is not in view.alive)."""

    view: View
    rank: int
    tag: str
    code: int  # the shell's code: 128+N for signal N
    how: str  # "exit code 1", "killed by SIGKILL"
    done: bool = False  # it sent `done`
    killed_by_us: bool = False  # we SIGKILLed it
    failure: RootCause | None = None  # code != 0: its root cause, as the loop read it (error file, tail)
    where: str = ""  # where it was (for an early exit's notice)
    spare: Spare | None = None  # code != 0: can a spare take its rank (None: no live recovery this attempt)


@dataclass(frozen=True)
class SignalReceived(Moment):
    """A signal to the supervisor itself (SIGCHLD and SIGCONT stay with the loop: I/O)."""

    signum: int


@dataclass(frozen=True)
class HangFound:
    """The heartbeat judge's verdict (or a rendezvous that never formed)."""

    view: View
    cause: RootCause
    responsive: frozenset[int] = frozenset()  # ranks whose liveness thread still answers
    spare: Spare | None = None  # can a spare take the hung rank (None: no live recovery this attempt)
    stopped: frozenset[int] = frozenset()  # ranks stopped (SIGSTOP, a debugger): they cannot answer anything


@dataclass(frozen=True)
class Fatal:
    """A watcher (the GPU watch), a helper process's death, or a node lost: tear down.
    `remote`: the job failed, or was stopped, on another node (its cause, not published back)."""

    view: View
    cause: RootCause
    remote: bool = False
    here: bool = False  # remote (from the job store), yet the cause names this node (node 0's agent: its own stall)


@dataclass(frozen=True)
class WorkerStop:
    """A stop signal reached a worker itself (SLURM signals every process of a step; or a
    `kill` aimed at one worker), which said so in a `stop` record."""

    view: View
    rank: int
    tag: str
    signame: str  # SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2


class TracesIn(Moment):
    """Every responsive rank dumped its collective trace."""


class AllGone(Moment):
    """No worker is left."""


class PipesClosed(Moment):
    """DRAINING: every pipe reached its end."""


@dataclass(frozen=True)
class ReplaceFailed:
    """`ReplaceLive` could not be carried out (no spare could be taken; live_recovery.py said why)."""

    view: View
    rank: int
    cause: RootCause


@dataclass(frozen=True)
class RecoveryStuck:
    """A survivor stayed in a collective of the broken group after a live recovery's loss
    (live_recovery.py's `stuck`): it can never rejoin."""

    view: View
    cause: RootCause


@dataclass(frozen=True)
class TracesRead:
    """What `AnalyseTraces` found: one line per rank, said and added to the root cause's evidence."""

    view: View
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Published:
    """The root cause as whoever listens published it (attempt_run.py names a stop SLURM sent): it
    becomes the root cause. Publishing runs off the loop, so events may have completed the
    cause meanwhile (`of`: the cause as it was published): then only its words are taken."""

    view: View
    cause: RootCause
    of: RootCause | None = None


@dataclass(frozen=True)
class TailsRead:
    """Every pipe is drained (after DONE): each rank's stderr tail, complete now."""

    view: View
    tails: tuple[tuple[int, tuple[str, ...]], ...]


@dataclass(frozen=True)
class SpareReady:
    """A warm spare stands by while the group is shrunk (live_recovery.py's `regrow_candidate`):
    it can take back carried rank `rank`."""

    view: View
    rank: int


@dataclass(frozen=True)
class StragglerFound:
    """A rank slower than the others for the set time (health/straggler_moves.py): `cause` (kind
    `straggler`) names it with its evidence; `spare`: whether it can be moved out live now."""

    view: View
    cause: RootCause
    spare: Spare | None = None  # None: no live recovery this attempt
    how: str = "a warm spare takes its rank"  # or the group goes on without it (--min-replicas)


Event = Tick | Exited | SignalReceived | WorkerStop | HangFound | Fatal | TracesIn | AllGone | PipesClosed | \
    TracesRead | Published | TailsRead | ReplaceFailed | RecoveryStuck | SpareReady | StragglerFound


# ---------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class Send:
    ranks: tuple[int, ...]
    signum: int
    group: bool = True  # the whole process group; False: the leader only


@dataclass(frozen=True)
class Log:
    level: str  # "info" | "warning" | "error"
    message: str


@dataclass(frozen=True)
class Note:
    message: str  # for the summary's notes


@dataclass(frozen=True)
class Publish:
    """The root cause was set: tell whoever listens (multi-node: the other nodes)."""

    cause: RootCause


@dataclass(frozen=True)
class RequestTraces:
    pass


@dataclass(frozen=True)
class AnalyseTraces:
    """Read the traces the ranks dumped and answer with `TracesRead` (one evidence line each)."""


@dataclass(frozen=True)
class Forward:
    ranks: tuple[int, ...]
    skipped: tuple[str, ...]
    signum: int


@dataclass(frozen=True)
class ReplaceLive:
    """A warm spare takes the lost rank (live_recovery.py promotes it; its pipes and heartbeats
    are read as the rank's from then on). None could be taken: answer with `ReplaceFailed`."""

    rank: int
    cause: RootCause  # what happened to the lost rank (its exit, or the hang verdict it was killed for)


@dataclass(frozen=True)
class GiveUpLive:
    """Live recovery cannot take this loss: a recovery in flight failed with `cause`."""

    cause: RootCause


@dataclass(frozen=True)
class Regrow:
    """A warm spare takes back carried rank `rank` (live_recovery.py promotes it; the group
    rebuilds with it at its next step boundary); its pipes and heartbeats are the rank's from now on."""

    rank: int


Action = Send | Log | Note | Publish | RequestTraces | AnalyseTraces | Forward | ReplaceLive | GiveUpLive | Regrow


# ---------------------------------------------------------------------------- state


@dataclass(frozen=True)
class EarlyExit:
    rank: int
    tag: str
    ended: float
    where: str
    told: bool = False  # its INFO line was said


@dataclass(frozen=True)
class State:
    phase: Phase = Phase.RUNNING
    deadline: float | None = None  # when the phase's wait is over
    cause: RootCause | None = None
    failed_at: float | None = None
    stop_signal: int | None = None  # the supervisor itself was asked to stop (never restart then)
    interrupts: int = 0
    terminations: int = 0  # SIGTERM, SIGHUP, SIGQUIT
    graceful: GracefulStop | None = None
    early: EarlyExit | None = None
    trace_ranks: frozenset[int] = field(default_factory=frozenset)  # DUMPING_TRACES: who is to answer
    writes_told: bool = False  # a teardown waits for a background checkpoint write (said once)
    condemned: tuple[tuple[int, RootCause], ...] = ()  # hung ranks SIGKILLed for a live recovery: their verdicts
    stacks_asked: float | None = None  # a hang: when the stacks signal went out (with the trace request)


Result = tuple[State, list[Action]]


def decide(state: State, event: Event, rules: Rules) -> Result:
    return _HANDLERS[type(event)](state, event, rules)


# ---------------------------------------------------------------------------- handlers


def _tick(s: State, e: Tick, r: Rules) -> Result:
    if s.deadline is None or e.view.now < s.deadline:
        return s, []
    return _deadline_passed(s, e.view, r)


def _deadline_passed(s: State, v: View, r: Rules) -> Result:
    """What each phase does when its wait is over."""
    if s.phase is Phase.FINISHING:
        return _finish_check(s, v, r)
    if s.phase is Phase.DUMPING_TRACES:
        return _stacks_settle(s, v, r, [AnalyseTraces()])
    if s.phase is Phase.DUMPING_STACKS:
        return _terminate(s, v, r)
    if s.phase in (Phase.STOPPING, Phase.TERMINATING):
        extended = _extend_stop(s, v, r) if s.phase is Phase.STOPPING else _wait_for_writes(s, v, r)
        if extended is not None:
            return extended
        actions: list[Action] = []
        if v.alive:
            over = "stop timeout" if s.graceful and v.now >= s.graceful.limit else "grace period"
            actions.append(Log("warning", f"{over} over: SIGKILL to {', '.join(w.tag for w in v.alive)}"))
            s = _cut_saves(s, v, r)
            actions += [Note(f"{w.tag} (rank {w.rank}) was killed while writing {w.writing.rsplit('/', 1)[-1]} in "
                             "the background: it never became a checkpoint (--resume takes an older one)")
                        for w in v.alive if w.writing is not None]
        return _kill(s, v, actions)
    if s.phase is Phase.KILLING:
        return replace(s, phase=Phase.DONE, deadline=None), [
            Note(f"some worker did not die within {KILL_WAIT:g} s of SIGKILL (uninterruptible sleep?)")]
    if s.phase is Phase.DRAINING:
        return replace(s, phase=Phase.DONE, deadline=None), []
    return s, []


def _finish_check(s: State, v: View, r: Rules) -> Result:
    """FINISHING's deadline. Ranks with heartbeats are judged by them (the heartbeat judge);
    ranks that never sent one make it a hang once the finish window after the clean exit is over."""
    early, actions = s.early, []
    if not early.told:
        early = replace(early, told=True)
        actions.append(Log("info", f"{early.tag} (rank {early.rank}) exited 0 first ({early.where}); rank(s) "
                                   f"{', '.join(str(w.rank) for w in v.alive)} may finish at their own pace: "
                                   f"a hang only after {r.finish_window:g} s without progress"))
    s = replace(s, early=early)
    silent = [str(w.rank) for w in v.alive if not w.heard]
    if not silent or v.now - early.ended < r.finish_window:
        return replace(s, deadline=early.ended + r.finish_window if silent else None), actions
    cause = RootCause("early-exit", int(ExitCode.HANG),
                      f"{early.tag} (rank {early.rank}) exited 0, then rank(s) {', '.join(silent)} made no progress "
                      f"for {r.finish_window:g} s (stuck waiting for it?)", rank=early.rank, device=early.tag)
    s, more = _diagnose(s, v, r, cause, frozenset())
    return s, actions + more


def _exited(s: State, e: Exited, r: Rules) -> Result:
    v = e.view
    if s.cause is not None:
        return _ended_during_stop(s, e, r), []
    if e.code != 0:
        condemned = dict(s.condemned)
        verdict = condemned.pop(e.rank, None)  # killed for a live recovery: the hang is its cause
        s = replace(s, condemned=tuple(condemned.items()))
        cause = verdict or e.failure or RootCause("worker-exit", e.code, f"{e.tag} (rank {e.rank}) {e.how}",
                                                  rank=e.rank, device=e.tag)
        return _lost(s, v, r, e.rank, cause, e.spare)
    if not v.alive or e.done or s.phase is not Phase.RUNNING:
        return s, []
    early = EarlyExit(e.rank, e.tag, v.now, e.where)
    return replace(s, early=early, phase=Phase.FINISHING,
                   deadline=v.now + min(EARLY_EXIT_NOTICE, r.finish_window)), []


def _lost(s: State, v: View, r: Rules, rank: int, cause: RootCause, spare: Spare | None) -> Result:
    """A rank failed: a warm spare takes it (live recovery, no teardown), or the attempt ends."""
    if spare is not None and spare.why_not is None:
        return s, [ReplaceLive(rank, cause)]
    actions: list[Action] = [] if spare is None else [
        GiveUpLive(cause), Log("warning", f"live recovery not possible: {spare.why_not}")]
    s, more = _failed(s, v, r, cause)
    return s, actions + more


def _failed(s: State, v: View, r: Rules, cause: RootCause) -> Result:
    """The root cause, and the teardown (after an early exit, a peer's absence blames that rank)."""
    if s.early is not None and _on_its_absence(cause):
        cause = _first_to_leave(s.early, cause)
    s, publish = _set_cause(s, cause, v.now)
    s, signals = _terminate(s, v, r)
    return s, signals + publish  # the ranks first: publishing starts a thread (and may ask SLURM)


def _replace_failed(s: State, e: ReplaceFailed, r: Rules) -> Result:
    if s.cause is not None:
        return s, []
    return _failed(s, e.view, r, e.cause)


def _spare_ready(s: State, e: SpareReady, r: Rules) -> Result:
    """Grow back only while training runs undisturbed: a stop, a teardown, or an early exit ends
    the attempt anyway, and a hung rank SIGKILLed for a recovery is about to be lost (its loss
    shrinks or takes the spare): the spare waits for the next look."""
    if s.cause is not None or s.phase is not Phase.RUNNING or s.condemned:
        return s, []
    return s, [Regrow(e.rank)]


def _recovery_stuck(s: State, e: RecoveryStuck, r: Rules) -> Result:
    """The recovery in flight failed; the attempt ends as on a watcher's verdict (a restart). A
    survivor stuck in the broken group's collective is a hang: every live worker's Python stacks
    are asked for first, so the worker logs show where it waits (no trace: the group is broken)."""
    if s.cause is not None:
        return s, []
    if e.cause.kind == "hang":
        s, actions = _diagnose(s, e.view, r, e.cause, responsive=frozenset())
        return s, [GiveUpLive(e.cause), *actions]
    s, actions = _fatal(s, Fatal(e.view, e.cause), r)
    return s, [GiveUpLive(e.cause), *actions]


# What a rank says when a peer it talks to is gone (gloo's and NCCL's words, and the socket's)
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "recvbytes", "sendbytes",
             "nccl communicator was aborted", "ncclremoteerror", "remote process exited", "socket closed",
             "connection refused")


def _on_its_absence(failure: RootCause) -> bool:
    """Did this failure come from a peer being gone? A rank that fails on its own account (its
    own exception, a signal, a timer that killed it) is the root cause even after an early exit."""
    said = " ".join([failure.message, *failure.stderr_tail, *failure.traceback]).lower()
    return any(words in said for words in PEER_GONE)


def _first_to_leave(early: EarlyExit, failure: RootCause) -> RootCause:
    """A rank left (exit 0, no `done`) while others ran, and then one of those failed: in a
    collective job that failure is most likely its absence (a closed connection, a peer
    gone), so the first rank to leave is the root cause and the failure its consequence
    (its last stderr line said, its stderr tail kept for the root-cause block)."""
    said = next((line.strip() for line in reversed(failure.stderr_tail) if line.strip()), "")
    consequence = failure.message + (f" ({said})" if said and said not in failure.message else "")
    return replace(failure, kind="early-exit", rank=early.rank, device=early.tag,
                   message=f"{early.tag} (rank {early.rank}) left first: it exited 0 ({early.where}) while the "
                           f"others still ran; then {consequence}: a consequence of its absence")


def _ended_during_stop(s: State, e: Exited, r: Rules) -> State:
    if s.graceful is not None and r.save_signal is not None and not e.killed_by_us:
        return replace(s, graceful=s.graceful.ended(f"{e.tag} (rank {e.rank})", e.code, e.how))
    return s


def _signal(s: State, e: SignalReceived, r: Rules) -> Result:
    if e.signum == signal.SIGINT:
        return _interrupt(s, e.view, r)
    if e.signum == signal.SIGQUIT:
        return _quit(s, e.view, r)
    if e.signum in (signal.SIGUSR1, signal.SIGUSR2) and r.save_signal is None:
        return s, [_forward(e.view, e.signum)]  # a --script's own business (Lightning's SLURM requeue, say)
    return _stop_request(s, e.view, r, e.signum)


def ctrl_c_wait(v: View, r: Rules) -> float:
    """Ctrl-C: the grace period plus the step in flight (the longest step seen, with a margin),
    never past the stop timeout. A rank still in its step, or saving, when it is over gets more
    (`_extend_stop`)."""
    return min(r.stop_timeout, r.grace + STEP_MARGIN * (v.step_s or 0.0))


def _interrupt(s: State, v: View, r: Rules) -> Result:
    s = replace(s, interrupts=s.interrupts + 1, stop_signal=s.stop_signal or signal.SIGINT)
    cause = RootCause("interrupted", int(ExitCode.SIGINT), "interrupted by Ctrl-C (SIGINT)")
    if s.interrupts == 1 and s.cause is None:
        wait = ctrl_c_wait(v, r)
        s, actions = _set_cause(s, cause, v.now)
        actions.append(Log("warning", _ctrl_c_line(v, r, wait)))
        s, more = _stop_all(s, v, r, signal.SIGINT, wait)
        return s, actions + more
    if s.interrupts == 1 and s.phase is Phase.STOPPING:
        # The first Ctrl-C heard here, while a graceful stop is under way: often the same Ctrl-C
        # (a terminal or srun signals every node) heard first from another node through the job
        # store, or from a worker. Killing now would throw away the save every rank is heading for.
        return s, [Log("warning", f"Ctrl-C: the graceful stop already under way goes on ({s.cause.message}); "
                                  "press Ctrl-C again to kill every worker now")]
    actions = [Log("warning", f"Ctrl-C {'again' if s.interrupts > 1 else 'during the teardown'}: "
                              "killing every worker now")]
    if s.cause is None:
        s, more = _set_cause(s, cause, v.now)
        actions += more
    return _kill_now(s, v, r, actions)


def _ctrl_c_line(v: View, r: Rules, wait: float) -> str:
    """The built-in trainer saves at a step boundary; a --script gets SIGINT, and what it does
    with it is its own (Lightning saves nothing on KeyboardInterrupt): the end of the run says
    whether a save followed (attempt_run.py)."""
    step = f"the step in flight (about {v.step_s:.0f} s) and " if v.step_s and v.step_s >= 1 else ""
    longer = f"longer while a rank is still in its step or saving, at most {r.stop_timeout:g} s"
    if r.save_signal is None:
        return (f"Ctrl-C: SIGINT to every worker; what the script does with it is its own (gpuherd saves nothing "
                f"for a script; the end of the run says whether a save followed): waiting up to {wait:.0f} s for "
                f"{step}them to exit ({longer}); press Ctrl-C again to kill them now")
    return (f"Ctrl-C: asking every worker to stop at a step boundary and save a checkpoint: waiting up to "
            f"{wait:.0f} s for {step}the save ({longer}); press Ctrl-C again to kill them now")


def _quit(s: State, v: View, r: Rules) -> Result:
    """SIGQUIT (Ctrl-\\): quit, as torchrun does: the workers are torn down (no save), the
    summary is written, exit 131. During a teardown or a stop already under way: SIGKILL now."""
    s = replace(s, terminations=s.terminations + 1, stop_signal=s.stop_signal or signal.SIGQUIT)
    if s.cause is not None:
        return _kill_now(s, v, r, [Log("warning", "SIGQUIT during the teardown: killing every worker now")])
    s, actions = _set_cause(s, RootCause("terminated", stop_exit_code(signal.SIGQUIT), "the supervisor received SIGQUIT",
                                     signal="SIGQUIT"), v.now)
    actions.append(Log("warning", f"supervisor received SIGQUIT: {signal.Signals(r.teardown_signal).name} to every "
                                  f"worker (no save), SIGKILL after "
                                  f"{r.grace:g} s; SIGQUIT again to kill them now"))
    s, more = _terminate(s, v, r)
    return s, actions + more


def _stop_request(s: State, v: View, r: Rules, signum: int) -> Result:
    """SIGTERM/SIGHUP (scancel, a preemption, a closed terminal) or, for gpuherd's worker,
    SIGUSR1/SIGUSR2 (SLURM's warning before the time limit): save and stop. A second
    SIGTERM/SIGHUP kills; a later SIGUSR1/2 changes nothing."""
    name = signal.Signals(signum).name
    terminating = signum in (signal.SIGTERM, signal.SIGHUP)
    repeated = terminating and s.terminations > 0
    s = replace(s, stop_signal=s.stop_signal or signum, terminations=s.terminations + int(terminating))
    if s.cause is None:  # the workers first, then the cause (its publishing asks SLURM what it was)
        s, actions = _save_and_stop(s, v, r, f"supervisor received {name}")
        s, more = _set_cause(s, RootCause("terminated", stop_exit_code(signum), f"the supervisor received {name}",
                                          signal=name), v.now)
        return s, actions + more
    if repeated:
        return _kill_now(s, v, r, [Log("warning", f"{name} again: killing every worker now")])
    return s, []


def _worker_stop(s: State, e: WorkerStop, r: Rules) -> Result:
    """The same save and stop as the supervisor's own, for every worker (and, through the
    published cause, every node). Never a kill: only the supervisor's own signals repeat."""
    if s.cause is not None:
        return s, []
    v, who = e.view, f"{e.tag} (rank {e.rank})"
    interrupted = e.signame == "SIGINT"
    if e.signame in signal.Signals.__members__:
        s = replace(s, stop_signal=s.stop_signal or signal.Signals[e.signame])
    if interrupted:
        s, actions = _stop_all(s, v, r, signal.SIGINT, ctrl_c_wait(v, r))
    else:
        s, actions = _save_and_stop(s, v, r, f"{who} received {e.signame}")
    cause = RootCause("interrupted" if interrupted else "terminated",
                      int(ExitCode.SIGINT if interrupted else ExitCode.SIGTERM), f"{who} received {e.signame}",
                      signal=e.signame if e.signame in signal.Signals.__members__ else None)
    s, more = _set_cause(s, cause, v.now)
    return s, actions + more


def _forward(v: View, signum: int) -> Forward:
    """Pass SIGUSR1/SIGUSR2 on to every worker that handles it (to one that does not, its
    default action would be death)."""
    return Forward(tuple(w.rank for w in v.alive if signum in w.handles),
                   tuple(w.tag for w in v.alive if signum not in w.handles), signum)


def _hang(s: State, e: HangFound, r: Rules) -> Result:
    if s.cause is not None:
        return s, []
    cause = e.cause
    if cause.kind == "hang" and cause.rank in dict(s.condemned):
        return s, []  # killed for a live recovery already, not reaped yet
    if cause.kind == "hang" and e.spare is not None and e.spare.why_not is None:
        return _kill_for_recovery(s, cause)
    if s.early is not None:
        cause = replace(cause, message=cause.message + f"; {s.early.tag} (rank {s.early.rank}) had exited 0 "
                                                       f"{e.view.now - s.early.ended:.0f} s before (waiting for it?)")
    return _diagnose(s, e.view, r, cause, e.responsive, e.stopped)


def _kill_for_recovery(s: State, cause: RootCause) -> Result:
    """A hung rank a warm spare can replace: SIGKILLed now instead of the hang teardown; when
    it is reaped, its exit is replaced live with the verdict as its cause (`_exited`)."""
    return replace(s, condemned=(*s.condemned, (cause.rank, cause))), [
        Log("error", f"{cause.message}; SIGKILL to {cause.device} (rank {cause.rank}) for a live recovery"),
        Send((cause.rank,), signal.SIGKILL)]


def _straggler(s: State, e: StragglerFound, r: Rules) -> Result:
    """Moved out only while training runs undisturbed (no stop, teardown, early exit or recovery
    under way): SIGKILL, and on its exit a warm spare takes the rank (or the group shrinks) with
    the straggler verdict as the cause; it never ends the attempt. Else it is named only, and why."""
    cause = e.cause
    if s.cause is not None or s.phase is not Phase.RUNNING or s.early is not None or s.condemned:
        return s, []
    if e.spare is None or e.spare.why_not is not None:
        why = e.spare.why_not if e.spare is not None else "live recovery is off in this attempt"
        return s, [Log("warning", f"{cause.message}; not moved out: {why}")]
    return replace(s, condemned=(*s.condemned, (cause.rank, cause))), [
        Log("warning", f"{cause.message}; moved out live: SIGKILL to {cause.device} (rank {cause.rank}), {e.how} "
                       "and the device goes on the suspect list"),
        Send((cause.rank,), signal.SIGKILL)]


def _fatal(s: State, e: Fatal, r: Rules) -> Result:
    if e.remote:
        return _remote(s, e, r)
    if s.cause is not None:
        return s, [Note(f"also reported after the root cause: {e.cause.message}")]
    s, publish = _set_cause(s, e.cause, e.view.now)
    s, signals = _terminate(s, e.view, r)
    return s, [Log("error", e.cause.message), *signals, *publish]


def _remote(s: State, e: Fatal, r: Rules) -> Result:
    if s.cause is not None:
        return s, []
    s = replace(s, cause=e.cause, failed_at=e.view.now)  # not published back: it came from the store
    if e.cause.kind == "interrupted":  # Ctrl-C on another node: stop gracefully here too, so the
        # ranks agree on a last step and save the checkpoint together
        s, actions = _stop_all(s, e.view, r, signal.SIGINT, ctrl_c_wait(e.view, r))
        return s, [Log("warning", f"{e.cause.message}: asking this node's workers to stop at a step boundary"),
                   *actions]
    if e.cause.kind in ("terminated", "membership"):  # the same for a stop request (a preemption) there,
        return _save_and_stop(s, e.view, r, e.cause.message)  # and for a node asking to join (elastic)
    if e.cause.kind == "straggler":  # node 0 moved this node out: the other nodes' workers rebuild their group
        # with a spare node's the moment these are gone, as for a node that died whole; nothing to save here
        return _kill(s, e.view, [Log("warning", f"{e.cause.message}; stopping this node's workers at once")])
    s, actions = _terminate(s, e.view, r)
    where = "on this node" if e.here else "on another node"
    return s, [Log("error", f"the job failed {where}: {e.cause.message}; stopping this node's workers"),
               *actions]


def _traces_in(s: State, e: TracesIn, r: Rules) -> Result:
    if s.phase is not Phase.DUMPING_TRACES:
        return s, []
    return _stacks_settle(s, e.view, r, [AnalyseTraces()])


def _all_gone(s: State, e: AllGone, r: Rules) -> Result:
    return replace(s, phase=Phase.DRAINING, deadline=e.view.now + DRAIN_WAIT), []


def _pipes_closed(s: State, e: PipesClosed, r: Rules) -> Result:
    if s.phase is Phase.DRAINING:
        return replace(s, phase=Phase.DONE, deadline=None), []
    return s, []


def _traces_read(s: State, e: TracesRead, r: Rules) -> Result:
    if s.cause is not None:
        s = replace(s, cause=replace(s.cause, evidence=[*s.cause.evidence, *e.lines]))
    return s, [Log("error", line) for line in e.lines]


def _published(s: State, e: Published, r: Rules) -> Result:
    if s.cause is None:
        return s, []
    if e.of is None or e.of == s.cause:
        return replace(s, cause=e.cause), []
    return replace(s, cause=replace(s.cause, message=e.cause.message)), []


def _tails_read(s: State, e: TailsRead, r: Rules) -> Result:
    """A cause of this node's gets its rank's complete stderr tail (an early exit's cause keeps
    the failing rank's tail it already holds)."""
    cause, tails = s.cause, dict(e.tails)
    if cause is None or cause.node is not None or cause.rank not in tails or \
            (cause.kind == "early-exit" and cause.stderr_tail):
        return s, []
    return replace(s, cause=replace(cause, stderr_tail=list(tails[cause.rank]))), []


_HANDLERS = {Tick: _tick, Exited: _exited, SignalReceived: _signal, WorkerStop: _worker_stop, HangFound: _hang,
             Fatal: _fatal, TracesIn: _traces_in, AllGone: _all_gone, PipesClosed: _pipes_closed,
             TracesRead: _traces_read, Published: _published, TailsRead: _tails_read, ReplaceFailed: _replace_failed,
             RecoveryStuck: _recovery_stuck, SpareReady: _spare_ready, StragglerFound: _straggler}


# ---------------------------------------------------------------------------- steps


def _set_cause(s: State, cause: RootCause, now: float) -> Result:
    return replace(s, cause=cause, failed_at=now), [Publish(cause)]


def _escalate(s: State, phase: Phase, now: float, wait: float | None) -> State:
    """Move on to a harsher teardown phase; never back to a gentler one."""
    if s.phase in _TEARDOWN_ORDER and _TEARDOWN_ORDER.index(s.phase) >= _TEARDOWN_ORDER.index(phase):
        return s
    return replace(s, phase=phase, deadline=None if wait is None else now + wait)


def _ranks(v: View) -> tuple[int, ...]:
    return tuple(w.rank for w in v.alive)


def _terminate(s: State, v: View, r: Rules, wait: float | None = None) -> Result:
    """The teardown signal (+ SIGCONT, so a stopped worker can act on it) to every group at once;
    a rank hung by the verdict gets SIGKILL (it could not act on a signal: its grace would only
    be waited out)."""
    hung = _hung_rank(s, v)
    rest = tuple(rank for rank in _ranks(v) if rank != hung)
    actions: list[Action] = [Send((hung,), signal.SIGKILL)] if hung is not None else []
    if rest:
        actions += [Send(rest, r.teardown_signal), Send(rest, signal.SIGCONT)]
    return _escalate(s, Phase.TERMINATING, v.now, r.grace if wait is None else wait), actions


def _kill_now(s: State, v: View, r: Rules, actions: list[Action]) -> Result:
    """The user's "now" (a repeated stop signal) during a graceful stop: a final save it cuts
    is recorded as cut, as when the stop timeout runs out, so the run never reports a saved stop."""
    return _kill(_cut_saves(s, v, r), v, actions)


def _hung_rank(s: State, v: View) -> int | None:
    """The live rank a hang verdict named (None: no hang, or it is gone)."""
    if s.cause is None or s.cause.kind != "hang" or s.cause.node is not None:
        return None
    return s.cause.rank if s.cause.rank in _ranks(v) else None


def _kill(s: State, v: View, actions: list[Action]) -> Result:
    if v.alive:
        actions = [*actions, Send(_ranks(v), signal.SIGKILL)]
    return _escalate(s, Phase.KILLING, v.now, KILL_WAIT), actions


def _begin_graceful(s: State, v: View, r: Rules) -> State:
    if s.graceful is not None:
        return s
    return replace(s, graceful=GracefulStop(started=v.now, limit=v.now + r.stop_timeout))


def _stop_all(s: State, v: View, r: Rules, signum: int, wait: float) -> Result:
    """Graceful: `signum` to each worker's leader (SIGINT: Ctrl-C; the save signal: a stop
    request); they stop at a step boundary and save. A worker still starting, with no
    handler for the save signal yet, has nothing to save: it gets the teardown signal."""
    leaders = tuple(w.rank for w in v.alive if signum == signal.SIGINT or signum in w.handles)
    starting = tuple(w.rank for w in v.alive if w.rank not in leaders)
    actions: list[Action] = []
    if leaders:
        actions.append(Send(leaders, signum, group=False))
    if starting:
        actions.append(Send(starting, r.teardown_signal))
    s = _begin_graceful(s, v, r)
    return _escalate(s, Phase.STOPPING, v.now, wait), actions


def _save_and_stop(s: State, v: View, r: Rules, why: str) -> Result:
    """A stop request: every worker finishes its step, saves and exits 143, within the stop timeout."""
    if r.save_signal is None:  # a --script: SIGTERM, as torchrun sends it, and the time to act on it
        s, actions = _terminate(_begin_graceful(s, v, r), v, r, wait=r.stop_timeout)
        return s, [Log("warning", f"{why}: SIGTERM to every worker, SIGKILL after {r.stop_timeout:g} s "
                                  "(the stop timeout)"), *actions]
    s, actions = _stop_all(s, v, r, r.save_signal, r.stop_timeout)
    return s, [Log("warning", f"{why}: every worker finishes its step, saves a checkpoint and stops (exit 143) "
                              f"within {r.stop_timeout:g} s (the stop timeout)"), *actions]


def _extend_stop(s: State, v: View, r: Rules) -> Result | None:
    """A graceful stop's wait is over: while a worker still writes its checkpoint, or is still
    in the step it stops after (and for a grace period after a save), wait on, up to the stop
    timeout. None: nothing to wait for."""
    if s.graceful is None:
        return None
    saving = [w for w in v.alive if w.saving or w.writing is not None]
    stepping = [w for w in v.alive if w.in_step and w not in saving]
    ends = [w.save_ended for w in v.alive if w.save_ended is not None]
    deadline = s.graceful.next_deadline(v.now, r.grace, bool(saving or stepping), max(ends, default=None))
    if deadline is None:
        return None
    actions: list[Action] = []
    if (saving or stepping) and not s.graceful.extended:
        busy = saving or stepping
        what = "still saving a checkpoint" if saving else "still in the step it stops after"
        actions.append(Log("info", f"rank(s) {', '.join(str(w.rank) for w in busy)} {what}: waiting for it (at most "
                                   f"{s.graceful.limit - v.now:.0f} s more, the stop timeout)"))
        s = replace(s, graceful=replace(s.graceful, extended=True))
    return replace(s, deadline=deadline), actions


def _wait_for_writes(s: State, v: View, r: Rules) -> Result | None:
    """A teardown's grace is over: a rank still writing a checkpoint in the background
    (worker/saver.py: it finishes that write before it exits), or a --script's rank still inside
    torch.save (its bootstrap holds the SIGTERM to the save's end: worker/script_bootstrap.py),
    gets the time, up to the stop timeout after the failure, so a restart can resume from it.
    None: nothing to wait for."""
    hung = _hung_rank(s, v)  # its write is what hangs, or it cannot finish one: SIGKILLed with its writer
    script = r.save_signal is None
    writing = [w for w in v.alive if (w.writing is not None or (script and w.saving)) and w.rank != hung]
    limit = (s.failed_at if s.failed_at is not None else v.now) + r.stop_timeout
    if not writing or v.now >= limit:
        return None
    actions: list[Action] = []
    if not s.writes_told:
        s = replace(s, writes_told=True)
        how = "in the background" if all(w.writing is not None for w in writing) else "(torch.save)"
        actions.append(Log("info", f"{', '.join(w.tag for w in writing)} still writing a checkpoint {how}: "
                                   f"waiting for it (at most {limit - v.now:.0f} s more, the stop timeout)"))
    return replace(s, deadline=min(limit, v.now + r.grace)), actions


def _cut_saves(s: State, v: View, r: Rules) -> State:
    """Workers about to be killed in a graceful stop: whose final save does that cut?
    (gpuherd's worker saves at every graceful stop, then says `shutdown` on its way out.)"""
    if s.graceful is None:
        return s
    stop = s.graceful
    for w in v.alive:
        stop = stop.killed(f"{w.tag} (rank {w.rank})", w.saving, w.leaving, saves_always=r.save_signal is not None)
    return replace(s, graceful=stop)


def _diagnose(s: State, v: View, r: Rules, cause: RootCause, responsive: frozenset[int],
              stopped: frozenset[int] = frozenset()) -> Result:
    """A hang: the evidence is asked for at once and in parallel (every live worker's Python stacks
    and collective trace), bounded, and never waited for from a rank that cannot answer; a hung rank
    that is stopped is SIGKILLed at once (SIGKILL works on a stopped process, and its death frees
    the peers waiting on it), any other at the teardown. Then tear down."""
    s, actions = _set_cause(s, cause, v.now)
    actions.insert(0, Log("error", cause.message))
    hung = _hung_rank(s, v)
    if hung is not None and hung in stopped:
        # the kernel's word settles who hung: the others' traces are asked for (they stay in the
        # trace directory) but not waited for, so a restart follows as fast as after a kill
        actions += [Send((hung,), signal.SIGKILL),
                    Log("warning", f"{cause.device} (rank {hung}) is stopped and cannot answer: SIGKILL now")]
        v = replace(v, alive=tuple(w for w in v.alive if w.rank != hung))
        s, actions = _ask_stacks(s, v, r, actions)
        return _stacks_settle(s, v, r, [*actions, RequestTraces()] if r.traces else actions)
    s, actions = _ask_stacks(s, v, r, actions)
    responsive = responsive & frozenset(_ranks(v))
    if r.traces and responsive:
        return replace(_escalate(s, Phase.DUMPING_TRACES, v.now, TRACES_WAIT), trace_ranks=responsive), \
            [*actions, RequestTraces()]
    return _stacks_settle(s, v, r, actions)


def _ask_stacks(s: State, v: View, r: Rules, actions: list[Action]) -> Result:
    stacks = r.stacks_signal
    name = signal.Signals(stacks).name
    asked = [w for w in v.alive if stacks in w.handles]
    cannot = [w.tag for w in v.alive if stacks not in w.handles]
    actions = list(actions)
    if asked:
        actions += [Send(tuple(w.rank for w in asked), stacks, group=False),
                    Log("info", f"asked {', '.join(w.tag for w in asked)} for their Python stacks ({name}); they go "
                                "to the worker logs")]
        s = replace(s, stacks_asked=v.now)
    if cannot:
        actions.append(Note(f"{', '.join(cannot)} installed no {name} handler, so no stack dump; add "
                            f"`faulthandler.register(signal.{name})` to the script to get one"))
    return s, actions


def _stacks_settle(s: State, v: View, r: Rules, actions: list[Action]) -> Result:
    """The traces are in (or their wait is over): the teardown once the stacks asked for at the
    verdict had STACK_DUMP_WAIT (at most the grace period) to be written."""
    wait = 0.0 if s.stacks_asked is None else max(0.0, s.stacks_asked + min(STACK_DUMP_WAIT, r.grace) - v.now)
    return _escalate(s, Phase.DUMPING_STACKS, v.now, wait), list(actions)
