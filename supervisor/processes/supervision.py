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
the loop never blocks on it. At the end the loop waits for it at most ANNOUNCE_WAIT.

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

import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Record, Stop
from supervisor.health import PROC_SAMPLE_S, FatalCause, Heartbeats, MetricsSink, ProcReader, traces
from supervisor.output import LogRouter, WorkerPipes
from supervisor.processes import policy as pol
from supervisor.processes.error_file import error_file_for, read_error_file
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.policy import Phase
from supervisor.processes.signal_rules import inherited_ignored
from supervisor.processes.spare_requests import Answer, Facts, SpareDesk, judge
from supervisor.processes.spawn import WorkerProcess
from supervisor.processes.straggler_out import moved_out, straggler_cause, straggler_spare
from supervisor.processes.stopping import QUIT, STOP_REQUESTS, StopRules
from supervisor.summary import RootCause, how_it_ended, shell_code

LOOP_GAP = 1.0  # the loop slept this much longer than it asked to: the supervisor was stopped
CATCH_UP_CHUNKS = 256  # per pipe after a stop: 16 MiB, so a flooding worker cannot hold the loop
LIVE_STEP_S = 5.0  # a rank's liveness record this fresh saying phase `step`: it is inside a step
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGCHLD, signal.SIGCONT, QUIT, *STOP_REQUESTS)
ANNOUNCE_WAIT = 8.0  # at the end: the longest wait for a root cause still being published (scontrol's 5 s)


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
        self.unwatched_why = unwatched_why
        self.notes: list[str] = []
        self.all_gone_at: float | None = None
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._signals: list[int] = []
        self._fatal: queue.SimpleQueue[FatalCause] = queue.SimpleQueue()
        self.pipes = WorkerPipes(router, self._record, metrics.write_lines)
        self._reap_due = True
        self._last_reap = 0.0
        self._last_check = 0.0
        self.procs = ProcReader()  # the kernel's view of each worker, handed to the hang judge
        self._proc_read = float("-inf")
        self._old_handlers: dict[int, object] = {}
        self._helpers: list[tuple[str, subprocess.Popen, Callable[[], str]]] = []
        self._old_wakeup = -1
        self._remote: queue.SimpleQueue[RootCause] = queue.SimpleQueue()
        self._regroups: queue.SimpleQueue[tuple[int, dict | None]] = queue.SimpleQueue()
        self._published: queue.SimpleQueue[tuple[RootCause, RootCause | None]] = queue.SimpleQueue()
        self._announcing: list[threading.Thread] = []
        self._announce_lock = threading.Lock()  # an answer after the wait is over is dropped, never woken for
        self._announce_open = True
        self._events: deque[pol.Event] = deque()  # the policy's events not decided yet, oldest first
        self._deciding = False
        self._clock = clock
        self._on_cause = on_cause
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
        self.procs.watch(w.slot.rank, w.pid)

    def install_signal_handlers(self) -> None:
        """Before the first spawn: a SIGCHLD or Ctrl-C from then on is never missed."""
        def on_signal(signum: int, _frame: object) -> None:
            self._signals.append(signum)

        for sig in HANDLED_SIGNALS:
            if sig not in inherited_ignored():  # ignored when gpuherd started: ignored for the whole run
                self._old_handlers[sig] = signal.signal(sig, on_signal)
        self._old_wakeup = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)

    def restore_signal_handlers(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def report_fatal(self, cause: FatalCause) -> None:
        """Thread-safe: a watcher (or the rendezvous store) ends the run."""
        self._fatal.put(cause)
        self._wake()

    def report_remote(self, cause: RootCause) -> None:
        """Thread-safe: the job failed elsewhere (another node); tear this node down."""
        self._remote.put(cause)
        self._wake()

    def report_regroup(self, generation: int, claim: dict | None) -> None:
        """Thread-safe: a node of the job claimed rebuilt group `generation` (a multi-node live recovery)."""
        self._regroups.put((generation, claim))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake already

    # ------------------------------------------------------------------ the loop

    def run(self) -> RootCause | None:
        for rank, w in self.workers.items():
            self.pipes.add(rank, w.popen.stdout, w.popen.stderr, w.status_fd)
        self.pipes.wake_on(self._wake_r, self._drain_wakeups)
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
        for d in (self.state.deadline, self.router.next_deadline(), self._stop_due()):
            if d is not None:
                deadlines.append(d)
        return max(0.0, min(deadlines) - now)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

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
                if self._on_cause is not None:
                    self._announce(action.cause)
            elif isinstance(action, pol.RequestTraces):
                traces.request(self.trace_dir)
            elif isinstance(action, pol.AnalyseTraces):  # the collective traces are in (or their wait is over)
                lines = traces.analyse(self.trace_dir, sorted(self.workers))
                self._decide(pol.TracesRead(self._view(now), tuple(lines)))  # queued: decided after these actions
            elif isinstance(action, pol.Forward):
                self._forward(action)
            elif isinstance(action, pol.ReplaceLive):
                self._replace_live(action, now)
            elif isinstance(action, pol.Regrow):
                self._regrow(action, now)
            elif isinstance(action, pol.GiveUpLive) and self.live is not None:
                self.live.give_up(action.cause)

    def _announce(self, cause: RootCause) -> None:
        """`on_cause` on a worker thread: it may ask SLURM (a subprocess, seconds) or the store."""
        def publish() -> None:
            try:
                published = self._on_cause(cause)
            except Exception as exc:  # noqa: BLE001 - the cause stands as it is; the run goes on
                logger.warning(f"the root cause could not be published: {type(exc).__name__}: {exc}")
                published = None
            with self._announce_lock:
                if self._announce_open:  # else the loop is over and its wake-up pipe may be closed
                    self._published.put((cause, published))
                    self._wake()

        thread = threading.Thread(target=publish, name="gpuherd-publish", daemon=True)
        self._announcing.append(thread)
        thread.start()

    def _handle_published(self, now: float) -> None:
        while not self._published.empty():
            cause, published = self._published.get()
            if published is not None and published != cause:
                self._decide(pol.Published(self._view(now), published, of=cause))

    def _await_announcements(self) -> None:
        """The root cause as published becomes the attempt's, so its answer is waited for (bounded)."""
        deadline = time.monotonic() + ANNOUNCE_WAIT  # a real wait, whatever clock the policy is given
        for thread in self._announcing:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._announce_lock:
            self._announce_open = False
        if any(thread.is_alive() for thread in self._announcing):
            logger.warning(f"publishing the root cause took over {ANNOUNCE_WAIT:g} s: it stands as this node saw it")
        self._handle_published(self._clock())

    def _handle_signals(self, now: float) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGCHLD:
                self._reap_due = True
                self._proc_read = float("-inf")  # a worker stopped, continued or exited: /proc is read now
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
            self._decide(pol.Fatal(self._view(now), self._remote.get(), remote=True))
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
            failure = self._failure(w, code, now)
            spare = self._spare(w.slot.rank, suspect_gpu=_suspect_gpu(w, failure))
        self._decide(pol.Exited(self._view(now), w.slot.rank, w.slot.tag, code, how_it_ended(w.returncode),
                                done=st.done, killed_by_us="SIGKILL" in w.signalled, failure=failure,
                                where=st.describe(), spare=spare))

    def _failure(self, w: WorkerProcess, code: int, now: float) -> RootCause:
        """A worker's failure as the root cause: its own account first (torch's @record error
        file), else its status record."""
        message = (f"{w.slot.tag} (rank {w.slot.rank}) {how_it_ended(w.returncode, self.script)} "
                   f"after {now - w.started:.1f} s")
        error = read_error_file(error_file_for(w.log_path))
        st_error = self.heartbeats.ranks[w.slot.rank].error
        if error is not None or st_error:
            message += f": {error.message if error is not None else st_error}"
        return self._worker_cause("worker-exit", code, message, w,
                                  script_code=self.script and w.returncode > 0,  # a signal's death: nobody's code
                                  traceback=list(error.traceback) if error is not None else [])

    def _timers(self, now: float) -> None:
        if self.cause is None and (now - self._last_check >= 0.25 or self._proc_read_due(now)):
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
        unwatched = self.heartbeats.newly_unwatched(now, alive)
        if unwatched and self.unwatched_why:
            logger.info(f"rank(s) {', '.join(map(str, unwatched))} sent no heartbeat in their first "
                        f"{self.heartbeats.timeouts.allowance('startup'):g} s: {self.unwatched_why}")
        samples = ()
        if now - self._proc_read >= PROC_SAMPLE_S or self._proc_read_due(now):
            self._proc_read, samples = now, self.procs.read()
        verdict = self.heartbeats.check(now, alive, samples)
        while self.heartbeats.notices:
            logger.info(self.heartbeats.notices.pop(0))
        if verdict is None:
            return
        code = ExitCode.RENDEZVOUS if verdict.kind == "rendezvous" else ExitCode.HANG
        cause = self._worker_cause(verdict.kind, code, verdict.message, self.workers[verdict.rank],
                                   evidence=list(verdict.evidence))
        self._decide(pol.HangFound(self._view(now), cause, frozenset(self.heartbeats.responsive(now, alive)),
                                   spare=self._spare(verdict.rank),
                                   stopped=frozenset(w.slot.rank for w in self._alive() if w.stopped())))

    def _stop_due(self) -> float | None:
        """When the decisive rule for a stopped rank wants its /proc read (Heartbeats.stop_due): a
        stopped rank is judged the moment it has been stopped DECISIVE_STOP_S, not up to a sampling
        period later. None once a cause is set (the teardown judges nothing)."""
        return self.heartbeats.stop_due() if self.cause is None else None

    def _proc_read_due(self, now: float) -> bool:
        """A read out of turn: a SIGCHLD came (the kernel tells the parent at once when a child
        stops), or a stop is to be shown 3 s long (`_stop_due`)."""
        due = self._stop_due()
        return self._proc_read == float("-inf") or (due is not None and now >= due and self._proc_read < due)

    # ------------------------------------------------------------------ live recovery (live_recovery.py)

    def _spare(self, rank: int, suspect_gpu: bool = False) -> pol.Spare | None:
        """Can a warm spare take `rank` now, the other live ranks surviving (None: no live recovery)."""
        if self.live is None:
            return None
        return pol.Spare(self.live.why_not(rank, [w.slot.rank for w in self._alive() if w.slot.rank != rank],
                                           suspect_gpu=suspect_gpu))

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

    def _replace_live(self, action: pol.ReplaceLive, now: float) -> None:
        """The policy's `ReplaceLive`: live recovery takes the lost rank (live_policy.py decides: a
        warm spare, whose pipes and heartbeats are read as the rank's from now on, or with
        --min-replicas the survivors go on without it); if it cannot (said why), the policy decides."""
        lost = self.workers[action.rank]
        survivors = [o for o in self._alive() if o is not lost]
        recovered, new = (False, None) if self.live is None else \
            self.live.recover(lost, action.cause, survivors, now, suspect_gpu=_suspect_gpu(lost, action.cause))
        if not recovered:
            self._decide(pol.ReplaceFailed(self._view(now), action.rank, action.cause))
            return
        moved_out(self.live, self.heartbeats.stragglers, action.rank, now)
        if new is not None:
            self._serve(action.rank, new, now)

    def _offer_regrow(self, now: float) -> None:
        """A shrunk group and a warm spare: the policy decides whether it takes back a carried rank now."""
        rank = self.live.regrow_candidate() if self.live is not None else None
        if rank is not None:
            self._decide(pol.SpareReady(self._view(now), rank))

    def _regrow(self, action: pol.Regrow, now: float) -> None:
        """The policy's `Regrow`: a warm spare serves the carried rank from now on (its old process
        is long gone); the group rebuilds with it at its next step boundary."""
        carried = self.workers[action.rank]
        new = self.live.regrow(carried.slot, carried.log_path, self._alive(), now)
        if new is not None:
            self._serve(action.rank, new, now)

    def _answer_requests(self) -> None:
        """`gpuherd spare`: each request judged (spare_requests.judge) and answered; a granted one
        starts a spare, which takes its carried rank back once warm (`_offer_regrow`)."""
        for request in self.requests.take():
            verdict = judge(request, self._facts())
            answer = verdict if isinstance(verdict, Answer) else self._start_asked_spare(verdict)
            logger.log("INFO" if answer.granted else "WARNING", f"gpuherd spare: {answer.message}")
            self.requests.answer(request.id, answer)

    def _start_asked_spare(self, rank: int) -> Answer:
        tag = self.workers[rank].slot.tag
        try:
            spare = self.live.ask_spare(rank)
        except OSError as exc:
            return Answer(ExitCode.FAILURE, f"the spare for rank {rank} could not be started: {exc}")
        return Answer(ExitCode.OK, f"warm spare pid {spare.pid} started for rank {rank} on {tag}: the group grows "
                                   "back to it at a step boundary once it is warm",
                      rank=rank, device=tag, pid=spare.pid)

    def _facts(self) -> Facts:
        """What a spare request is judged by: the phase, the carried ranks, the spares already there."""
        live = self.live
        running = None if self.phase is Phase.RUNNING and self.cause is None else self.phase.value
        devices = {rank: (w.slot.tag, w.slot.uuid) for rank, w in self.workers.items()}
        if live is None:
            return Facts(running, "live recovery is off (--max-restarts with --min-replicas lets a group shrink, "
                                  "then grow back)", {}, devices, {})
        pids = [s.pid for s in live.pool.spares if s.poll() is None]
        carried = {rank: devices[rank][0] for rank in live.carried()}  # this node's: its spares take them back
        asked = {live.asked[pid]: pid for pid in pids if live.asked.get(pid) in carried}
        return Facts(running, live.off, carried, devices, asked, tuple(p for p in pids if p not in live.asked),
                     finished=live.finished, elsewhere=live.carried_elsewhere(), dead_nodes=live.dead_nodes())

    def _serve(self, rank: int, new: WorkerProcess, now: float) -> None:
        """`new` (a promoted spare) is `rank`'s worker: its pipes and heartbeats are read as the rank's."""
        self.workers[rank] = new
        self.heartbeats.rejoin(rank, now)
        self.procs.watch(rank, new.pid)
        self.pipes.replace(rank, new.popen.stdout, new.popen.stderr, new.status_fd)

    # ------------------------------------------------------------------ helpers

    def _alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers.values() if w.alive]

    def _worker_cause(self, kind: str, code: int, message: str, w: WorkerProcess, **more: object) -> RootCause:
        """A rank's cause, complete (RootCause is immutable): its stderr tail so far, and `more`."""
        log = self.router.logs[w.slot.rank]
        return RootCause(kind, int(code), message, rank=w.slot.rank, device=w.slot.tag,
                         stderr_tail=[line.decode(errors="replace") for line in log.stderr_tail], **more)

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


def _suspect_gpu(w: WorkerProcess, cause: RootCause) -> bool:
    """The rank left over its own GPU (exit 8, a suspect device; a straggler moved out): never
    replaced on the same GPU."""
    return w.slot.kind == "cuda" and (cause.exit_code == ExitCode.DEVICE_SUSPECT and not cause.script_code
                                      or cause.kind == "straggler")
