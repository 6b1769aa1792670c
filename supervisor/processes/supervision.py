"""The event loop of a running attempt: forward logs, read heartbeats, notice deaths, and
carry out what the supervision policy (policy.py) decides.

One thread, one epoll (output/pipes.py: the worker pipes, stdout, stderr, status), and a
wake-up pipe that signal handlers (SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1,
SIGUSR2, SIGCONT) and watcher threads write to. A death is seen the moment SIGCHLD arrives, not
at the next poll tick. After the supervisor itself was stopped (SIGCONT, or any gap in
the loop over LOOP_GAP), every pipe is read to the end and the hang clocks restart before
anyone is judged.

This class owns the attempt's processes: it reaps, signals, asks the heartbeat judge,
and turns what it saw into the policy's events (with a `View` of the live ranks);
`policy.decide` answers with the next state and the actions (signals to send, lines to
log, the root cause to publish), which `_apply` carries out. Every decision, and so every
phase transition, lives in policy.py. What came of an action that the policy must know (the
traces read, a replacement that failed, the cause as published) is queued as a new event and
decided after the current actions, never by calling back into the policy from inside them.
The time is the injected clock's (`time.monotonic` by default), so a test can drive it.

Publishing the root cause may be slow (under SLURM, attempt_run.py asks `scontrol` why the
job was stopped, up to its timeout; multi-node, the cause goes to the store): it runs on a
worker thread, its answer comes back through the wake-up pipe as a `Published` event, and
the loop never blocks on it. At the end the loop waits for it at most ANNOUNCE_WAIT (announcing.py).

Teardown: the teardown signal (gpuherd's worker: TEARDOWN_SIGNAL, which only the supervisor
sends; a --script: SIGTERM) (+ SIGCONT, so a stopped worker can act on it) to every worker's
process group at once, then SIGKILL what is left after the grace period (or later, up to
the stop timeout, while a rank still writes a checkpoint in the background: it finishes
that write before it exits, and a restart can resume from it). A graceful
stop (stopping.py) never SIGKILLs a worker while it reports phase `checkpoint`, up to
the stop timeout; a save it did have to cut is named in `graceful.unfinished`. The
exit code is the root cause's: the first failing worker's own code (or, when a rank
had left early, that rank is named: the first to leave), 124 for a hang or an early
clean exit the others then hung on, 5 for a process group that never formed, a
watcher's code, 130 for Ctrl-C, 128+N when the supervisor itself got
SIGTERM/SIGHUP/SIGQUIT, 143 for SIGUSR1/2.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Record, Stop
from supervisor.health import FatalCause, Heartbeats, MetricsSink, traces
from supervisor.output import LogRouter, WorkerPipes
from supervisor.processes import policy as pol
from supervisor.processes.announcing import Announcer
from supervisor.processes.hang_watch import HangWatch
from supervisor.processes.live_ranks import LiveRanks
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.policy import Phase
from supervisor.processes.spare_answers import answer_requests
from supervisor.processes.spare_requests import SpareDesk
from supervisor.processes.spawn import WorkerProcess
from supervisor.processes.straggler_out import straggler_cause, straggler_spare
from supervisor.processes.stopping import QUIT, STOP_REQUESTS, StopRules
from supervisor.processes.wakeups import WakeUps
from supervisor.processes.worker_causes import exit_failure, suspect_gpu, worker_cause
from supervisor.summary import RootCause, how_it_ended, shell_code

LOOP_GAP = 1.0  # the loop slept this much longer than it asked to: the supervisor was stopped
CATCH_UP_CHUNKS = 256  # per pipe after a stop: 16 MiB, so a flooding worker cannot hold the loop
LIVE_STEP_S = 5.0  # a rank's liveness record this fresh saying phase `step`: it is inside a step
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGCHLD, signal.SIGCONT, QUIT, *STOP_REQUESTS)


class Supervision:
    def __init__(self, workers: list[WorkerProcess], router: LogRouter, heartbeats: Heartbeats,
                 metrics: MetricsSink, stop: StopRules, finish_window: float,
                 on_cause: Callable[[RootCause], RootCause | None] | None = None,
                 on_record: Callable[[Record], None] | None = None, script: bool = False,
                 unwatched_why: str | None = None, trace_dir: Path | None = None,
                 live: LiveRecovery | None = None, requests: SpareDesk | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`on_cause`: told this node's root cause the moment it is set (multi-node: the job's
        rendezvous offers it to the other nodes); what it returns, if not None, is the cause as
        published (a SLURM stop named as such), and becomes the root cause. `on_record`: every
        status record, as it comes.
        `finish_window`: how long the ranks left after a clean early exit may go without
        progress. `script`: the workers run a user's script, whose exit codes are its own.
        `unwatched_why`: said once for ranks that never send a heartbeat. `trace_dir`: where
        workers dump their collective traces when asked (None: no traces asked for). `live`: a lost
        rank may be replaced by a warm spare instead of ending the attempt (live_recovery.py).
        `requests`: where an operator asks for a spare (`gpuherd spare`, spare_requests.py).
        `clock`: monotonic seconds (a test's fake clock)."""
        self.workers = {w.slot.rank: w for w in workers}
        self.router = router
        self.heartbeats = heartbeats
        self.metrics = metrics
        self.stop = stop
        self.rules = pol.Rules(grace=stop.grace, stop_timeout=stop.stop_timeout, save_signal=stop.save_signal,
                               finish_window=finish_window, traces=trace_dir is not None,
                               teardown_signal=stop.teardown_signal, stacks_signal=stop.stacks_signal)
        self.state = pol.State()
        self.script = script
        self.notes: list[str] = []
        self.all_gone_at: float | None = None
        self.wakeups = WakeUps()  # the signal handlers and other threads wake the loop through it
        self._fatal: queue.SimpleQueue[FatalCause] = queue.SimpleQueue()
        self.pipes = WorkerPipes(router, self._record, metrics.write_lines)
        self._reap_due = True
        self._last_reap = 0.0
        self._last_check = 0.0
        self.hangs = HangWatch(heartbeats, unwatched_why)  # when /proc is read, what the hang judge says
        self.ranks = LiveRanks(live, self.workers, heartbeats, self.hangs.procs, self.pipes)  # spares taking ranks
        self._helpers: list[tuple[str, subprocess.Popen, Callable[[], str]]] = []
        self._remote: queue.SimpleQueue[tuple[RootCause, bool]] = queue.SimpleQueue()
        self._regroups: queue.SimpleQueue[tuple[int, dict | None]] = queue.SimpleQueue()
        self.announcer = Announcer(on_cause, self.wakeups.wake)  # publishes the cause off the loop
        self._events: deque[pol.Event] = deque()  # the policy's events not decided yet, oldest first
        self._deciding = False
        self._clock = clock
        self._on_record = on_record
        self._resumed = False  # SIGCONT came: the supervisor itself was stopped meanwhile (I/O, not policy)
        self.trace_dir = trace_dir
        self.live = live
        self.requests, self._last_asked = requests, 0.0  # `gpuherd spare`: its requests, read every 0.25 s

    # the policy's state, as the loop reads it (attempt_run.py reads `state` itself)
    @property
    def phase(self) -> Phase:
        return self.state.phase

    @property
    def cause(self) -> RootCause | None:
        return self.state.cause

    # ------------------------------------------------------------------ setup

    def watch_helper(self, name: str, proc: subprocess.Popen, why: Callable[[], str]) -> None:
        """A process the run needs (the rendezvous store): its death while workers run ends the run."""
        self._helpers.append((name, proc, why))

    def add_worker(self, w: WorkerProcess) -> None:
        self.workers[w.slot.rank] = w
        self.heartbeats.ranks[w.slot.rank].spawned = w.started
        self.hangs.procs.watch(w.slot.rank, w.pid)

    def install_signal_handlers(self) -> None:
        """Before the first spawn: a SIGCHLD or Ctrl-C from then on is never missed."""
        self.wakeups.install(HANDLED_SIGNALS)

    def restore_signal_handlers(self) -> None:
        self.wakeups.restore()

    def report_fatal(self, cause: FatalCause) -> None:
        """Thread-safe: a watcher (or the rendezvous store) ends the run."""
        self._fatal.put(cause)
        self.wakeups.wake()

    def report_remote(self, cause: RootCause, here: bool = False) -> None:
        """Thread-safe: the job failed (on another node; `here`: the cause, from another node's agent,
        names this node); tear this node down."""
        self._remote.put((cause, here))
        self.wakeups.wake()

    def report_regroup(self, generation: int, claim: dict | None) -> None:
        """Thread-safe: a node of the job claimed rebuilt group `generation` (a multi-node live recovery)."""
        self._regroups.put((generation, claim))
        self.wakeups.wake()

    # ------------------------------------------------------------------ the loop

    def run(self) -> RootCause | None:
        for rank, w in self.workers.items():
            self.pipes.add(rank, w.popen.stdout, w.popen.stderr, w.status_fd)
        self.pipes.wake_on(self.wakeups.read_fd, self.wakeups.drain)
        while True:
            before = self._clock()
            timeout = self._timeout(before)
            self.pipes.wait(timeout)
            now = self._clock()
            self._handle_signals(now)
            if self._resumed or now - before > timeout + LOOP_GAP:
                self._catch_up()
                now = self._clock()
            self._handle_fatal(now)
            self._handle_published(now)
            if self._reap_due or now - self._last_reap > 0.5:
                self._reap(now)
            self._timers(now)
            self.router.tick(now)
            if self.phase is Phase.DONE:
                break
        self.pipes.close()
        self._await_announcements()
        tails = tuple((rank, tuple(line.decode(errors="replace") for line in log.stderr_tail))
                      for rank, log in self.router.logs.items())
        self._decide(pol.TailsRead(self._view(self._clock()), tails))  # complete, now that every pipe is drained
        return self.cause

    def _catch_up(self) -> None:
        """The supervisor was stopped (or starved) while the workers went on: what they said
        meanwhile is still in the pipes. Read it all, then count silence from now only."""
        self._resumed = False
        self.pipes.read_all(CATCH_UP_CHUNKS)
        self.heartbeats.restart_clocks(self._clock())

    def _timeout(self, now: float) -> float:
        deadlines = [now + 0.5]
        for d in (self.state.deadline, self.router.next_deadline(), self.hangs.stop_due(self.cause)):
            if d is not None:
                deadlines.append(d)
        return max(0.0, min(deadlines) - now)

    def _record(self, rank: int, record: Record, now: float) -> None:
        """A status record from `rank`: the heartbeat judge's, then whoever else listens."""
        self.heartbeats.record(rank, record, now)
        if isinstance(record, Stop) and rank in self.workers:
            w = self.workers[rank]
            self._decide(pol.WorkerStop(self._view(now), rank, w.slot.tag, str(record.signal)))
        if self._on_record is not None:
            self._on_record(record)

    # ------------------------------------------------------------------ events -> policy

    def _view(self, now: float) -> pol.View:
        """What the policy knows of the live ranks (from their records, their signal handlers)."""
        ranks = []
        for w in self._alive():
            st = self.heartbeats.ranks[w.slot.rank]
            live = st.live if st.live_at is not None and now - st.live_at <= LIVE_STEP_S else None
            ranks.append(pol.Rank(
                w.slot.rank, w.slot.tag, handles=w.handles((self.stop.stacks_signal, signal.SIGUSR1, signal.SIGUSR2)),
                saving=st.saving,
                writing=st.writing, in_step=live is not None and live.phase == "step",
                leaving=st.phase == "shutdown", save_ended=st.save_ended,
                heard=bool(st.records or self.heartbeats.expect)))
        return pol.View(now, tuple(ranks), step_s=self.heartbeats.longest_step())

    def _decide(self, event: pol.Event) -> None:
        """The policy decides `event`, then every follow-up event its actions queued, in order."""
        self._events.append(event)
        if self._deciding:  # an action's follow-up: decided once the actions under way are carried out
            return
        self._deciding = True
        try:
            while self._events:
                event = self._events.popleft()
                self.state, actions = pol.decide(self.state, event, self.rules)
                self._apply(actions, event.view.now)
        finally:
            self._deciding = False

    def _apply(self, actions: list[pol.Action], now: float) -> None:
        """Carry the policy's actions out; what came of one it must know is queued as a new event."""
        for action in actions:
            if isinstance(action, pol.Send):
                for rank in action.ranks:
                    w = self.workers[rank]
                    (w.signal_group if action.group else w.signal_leader)(action.signum)
                if action.signum == signal.SIGKILL:
                    self._reap_due = True
            elif isinstance(action, pol.Log):
                getattr(logger, action.level)(action.message)
            elif isinstance(action, pol.Note):
                self.notes.append(action.message)
            elif isinstance(action, pol.Publish):
                self.announcer.announce(action.cause)
            elif isinstance(action, pol.RequestTraces):
                traces.request(self.trace_dir)
            elif isinstance(action, pol.AnalyseTraces):  # the collective traces are in (or their wait is over)
                lines = traces.analyse(self.trace_dir, sorted(self.workers))
                self._decide(pol.TracesRead(self._view(now), tuple(lines)))  # queued: decided after these actions
            elif isinstance(action, pol.Forward):
                self._forward(action)
            elif isinstance(action, pol.ReplaceLive):
                if not self.ranks.replace(action.rank, action.cause, now):  # it said why; the policy decides
                    self._decide(pol.ReplaceFailed(self._view(now), action.rank, action.cause))
            elif isinstance(action, pol.Regrow):
                self.ranks.regrow(action.rank, now)
            elif isinstance(action, pol.GiveUpLive) and self.live is not None:
                self.live.give_up(action.cause)

    def _handle_published(self, now: float) -> None:
        for cause, published in self.announcer.answers():
            if published is not None and published != cause:
                self._decide(pol.Published(self._view(now), published, of=cause))

    def _await_announcements(self) -> None:
        """The root cause as published becomes the attempt's, so its answer is waited for (bounded)."""
        self.announcer.wait()
        self._handle_published(self._clock())

    def _handle_signals(self, now: float) -> None:
        while self.wakeups.signals:
            signum = self.wakeups.signals.pop(0)
            if signum == signal.SIGCHLD:
                self._reap_due = True
                self.hangs.read_now()  # a worker stopped, continued or exited: /proc is read now
            elif signum == signal.SIGCONT:
                self._resumed = True
            else:
                self._decide(pol.SignalReceived(self._view(now), signum))

    def _forward(self, action: pol.Forward) -> None:
        for rank in action.ranks:
            self.workers[rank].signal_leader(action.signum)
        sent = ", ".join(self.workers[r].slot.tag for r in action.ranks) or "no worker"
        logger.info(f"supervisor received {signal.Signals(action.signum).name}: forwarded to {sent}"
                    + (f"; not to {', '.join(action.skipped)}, which installed no handler for it"
                       if action.skipped else ""))

    def _handle_fatal(self, now: float) -> None:
        while not self._regroups.empty():
            self._heard_regroup(*self._regroups.get(), now)
        while not self._remote.empty():
            cause, here = self._remote.get()
            self._decide(pol.Fatal(self._view(now), cause, remote=True, here=here))
        while not self._fatal.empty():
            fatal = self._fatal.get()
            w = self.workers.get(fatal.rank) if fatal.rank is not None else None
            self._decide(pol.Fatal(self._view(now), RootCause(
                "watcher", int(fatal.exit_code), f"{fatal.name}: {fatal.message}", rank=fatal.rank,
                device=w.slot.tag if w else None)))

    def _reap(self, now: float) -> None:
        self._reap_due, self._last_reap = False, now
        for w in self._alive():
            if w.poll() is not None:
                self._on_exit(w, now)
        if self.all_gone_at is None and not self._alive():
            self.all_gone_at = now
            self._decide(pol.AllGone(self._view(now)))
        for name, proc, why in list(self._helpers):
            if proc.poll() is not None:
                self._helpers.remove((name, proc, why))
                if self.cause is None and self._alive():
                    message = why() or f"the {name} exited with code {proc.returncode}"
                    self._decide(pol.Fatal(self._view(now), RootCause("supervisor", ExitCode.FAILURE, message)))

    def _on_exit(self, w: WorkerProcess, now: float) -> None:
        self.pipes.drain(w.slot.rank)  # its last words first: its 'done' record, the traceback
        w.signal_group(signal.SIGKILL)  # what it forked and left behind in its group goes with it
        how = how_it_ended(w.returncode, self.script)
        logger.debug(f"{w.slot.tag} (rank {w.slot.rank}, pid {w.pid}) {how}")
        code = shell_code(w.returncode)
        st = self.heartbeats.ranks[w.slot.rank]
        failure, spare = None, None
        if code != 0 and self.cause is None:
            failure = exit_failure(w, code, now, self.router.logs[w.slot.rank], st.error, self.script)
            spare = self.ranks.spare(w.slot.rank, suspect=suspect_gpu(w, failure))
        self._decide(pol.Exited(self._view(now), w.slot.rank, w.slot.tag, code, how_it_ended(w.returncode),
                                done=st.done, killed_by_us="SIGKILL" in w.signalled, failure=failure,
                                where=st.describe(), spare=spare))

    def _timers(self, now: float) -> None:
        if self.cause is None and (now - self._last_check >= 0.25 or self.hangs.read_due(now, self.cause)):
            self._last_check = now
            self._judge_live_recovery(now)  # first: a survivor stuck in the broken group is no hang of its own
            if self.cause is None:
                self._judge_heartbeats(now)
            if self.cause is None:
                self._judge_stragglers(now)
            if self.cause is None:
                self._offer_regrow(now)
        if self.requests is not None and now - self._last_asked >= 0.25:
            self._last_asked = now
            self._answer_requests()
        if self.phase is Phase.DUMPING_TRACES:
            waited = set(self.state.trace_ranks) & {w.slot.rank for w in self._alive()}  # the dead answer nothing
            if traces.answered(self.trace_dir, waited) == waited:
                self._decide(pol.TracesIn(self._view(now)))
        if self.phase is Phase.DRAINING and not self.pipes.open:
            self._decide(pol.PipesClosed(self._view(now)))
        if self.state.deadline is not None and now >= self.state.deadline:
            self._decide(pol.Tick(self._view(now)))

    def _judge_heartbeats(self, now: float) -> None:
        alive = {w.slot.rank for w in self._alive()}
        verdict = self.hangs.verdict(now, alive, self.cause)
        if verdict is None:
            return
        code = ExitCode.RENDEZVOUS if verdict.kind == "rendezvous" else ExitCode.HANG
        cause = self._worker_cause(verdict.kind, code, verdict.message, self.workers[verdict.rank],
                                   evidence=list(verdict.evidence))
        self._decide(pol.HangFound(self._view(now), cause, frozenset(self.heartbeats.responsive(now, alive)),
                                   spare=self.ranks.spare(verdict.rank),
                                   stopped=frozenset(w.slot.rank for w in self._alive() if w.stopped())))

    # ------------------------------------------------------------------ live recovery (live_recovery.py)

    def _judge_stragglers(self, now: float) -> None:
        """A rank slower than the others for the set time (health/straggler_moves.py): the policy
        moves it out live where a warm spare can take it (straggler_out.py), else names it only."""
        stragglers = self.heartbeats.stragglers
        for due in stragglers.take_due() if stragglers is not None else ():
            w = self.workers.get(due.rank)
            if w is None or not w.alive or self.cause is not None:
                continue
            survivors = [o.slot.rank for o in self._alive() if o is not w]
            spare = straggler_spare(self.live, w.slot, due, survivors)
            why = "live recovery is off" if spare is None else spare.why_not
            if why is not None and stragglers.moves.said.get(due.rank) == why:
                continue  # said already: named only, until the answer changes
            stragglers.moves.said[due.rank] = why or ""
            how = ("the group goes on without it (--min-replicas)" if self.live is not None
                   and self.live.shrinks(w.slot.kind == "cuda") else "a warm spare takes its rank")
            self._decide(pol.StragglerFound(self._view(now), straggler_cause(due, w, stragglers.moves.factor),
                                            spare=spare, how=how))
            if due.rank in dict(self.state.condemned):
                stragglers.moves.pending[due.rank] = due  # SIGKILLed: its recovery gets the evidence

    def _judge_live_recovery(self, now: float) -> None:
        """A survivor that never left the broken group's collective: the policy ends the attempt."""
        if self.live is not None:
            self.live.pool.adopt()  # the spares a script's spare source forked meanwhile
        stuck = self.live.stuck(now, self.heartbeats.timeouts.allowance("step")) if self.live is not None else None
        if stuck is not None:
            message, rank = stuck
            self._decide(pol.RecoveryStuck(self._view(now), self._worker_cause("hang", ExitCode.HANG, message,
                                                                               self.workers[rank])))

    def _heard_regroup(self, generation: int, claim: dict | None, now: float) -> None:
        """Another node replaces a lost rank of its own: this node's ranks survive and rebuild the
        group; one that cannot (said why) ends the attempt, and with it the job's (a restart)."""
        if self.live is None or self.cause is not None:
            return
        why = self.live.heard(generation, claim, self._alive(), now)
        if why is not None:
            self._decide(pol.RecoveryStuck(self._view(now), RootCause("rendezvous", ExitCode.FAILURE, why)))

    def _offer_regrow(self, now: float) -> None:
        """A shrunk group and a warm spare: the policy decides whether it takes back a carried rank now."""
        rank = self.live.regrow_candidate() if self.live is not None else None
        if rank is not None:
            self._decide(pol.SpareReady(self._view(now), rank))

    def _answer_requests(self) -> None:
        """`gpuherd spare` (spare_answers.py); a granted spare takes its carried rank back once warm
        (`_offer_regrow`)."""
        running = None if self.phase is Phase.RUNNING and self.cause is None else self.phase.value
        answer_requests(self.requests, self.live, self.workers, running)

    # ------------------------------------------------------------------ helpers

    def _alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers.values() if w.alive]

    def _worker_cause(self, kind: str, code: int, message: str, w: WorkerProcess, **more: object) -> RootCause:
        return worker_cause(kind, code, message, w, self.router.logs[w.slot.rank], **more)

    def final_save(self) -> str | None:
        """After a graceful stop: "saved", "not saved" (see `graceful.unfinished`), or None."""
        stop = self.state.graceful
        if stop is None:
            return None
        saved = any(st.saved_at is not None and st.saved_at >= stop.started for st in self.heartbeats.ranks.values())
        return stop.outcome(saved)

    def force_kill_everything(self) -> None:
        """Last resort on a supervisor bug: no worker may outlive us."""
        for w in self.workers.values():
            w.signal_group(signal.SIGKILL)
            w.poll()

