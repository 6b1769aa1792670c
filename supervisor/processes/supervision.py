"""The event loop of a running job: forward logs, read heartbeats, notice deaths, tear down.

One thread, one epoll: worker pipes (stdout, stderr, status), and a wake-up pipe
that signal handlers (SIGCHLD, SIGINT, SIGTERM, SIGHUP) and watcher threads write
to. A death is seen the moment SIGCHLD arrives, not at the next poll tick.

The loop's phase (`Phase`) says what it is waiting for; each phase but RUNNING has
one deadline, and `_deadline_passed` is the one place that says what comes next:

    RUNNING --a rank exits 0 early--> FINISHING --others not done in time--> DUMPING_TRACES
    RUNNING/FINISHING --hang verdict--> DUMPING_TRACES --every responsive rank dumped its
        collective trace, or traces.WAIT_S--> DUMPING_STACKS --stacks written--> TERMINATING
    any live phase --failure, watcher, SIGTERM--> TERMINATING --grace over--> KILLING
    RUNNING --Ctrl-C--> STOPPING (workers save, exit 130) --grace over--> KILLING
    any --Ctrl-C again / SIGTERM again--> KILLING --KILL_WAIT--> DONE (a note: D-state?)
    any --no worker left--> DRAINING --pipes closed or DRAIN_WAIT--> DONE

Teardown: SIGTERM (+ SIGCONT, so a stopped worker can act on it) to every worker's
process group at once, then SIGKILL what is left after the grace period. The exit
code is the root cause's: the first failing worker's own code, 124 for a hang or an
early clean exit, 5 for a process group that never formed, a watcher's code,
130 for Ctrl-C, 128+N when the supervisor itself got signal N.
"""

from __future__ import annotations

import enum
import os
import queue
import selectors
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

from gpuherd.exit_codes import ExitCode
from gpuherd.status_channel import decode
from supervisor.health import FatalCause, Heartbeats, MetricsSink, traces
from supervisor.logs import STDERR, STDOUT, LogRouter
from supervisor.processes.spawn import WorkerProcess
from supervisor.summary import RootCause, how_it_ended, shell_code

READ_CHUNK = 1 << 16
STACK_DUMP_WAIT = 2.0  # after SIGUSR1, time for faulthandler's stacks to reach the logs
KILL_WAIT = 10.0  # after SIGKILL: a process in uninterruptible sleep (a wedged driver) may linger
DRAIN_WAIT = 2.0  # after the last worker: pipes a setsid'd grandchild still holds are given up
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)


class Phase(enum.Enum):
    RUNNING = "running"  # judging heartbeats; no deadline
    FINISHING = "finishing"  # a rank exited 0 early: the others get the finish window to end too
    DUMPING_TRACES = "dumping traces"  # hang verdict: collective traces requested; stacks at the deadline
    STOPPING = "stopping"  # graceful stop (Ctrl-C): workers save and exit; SIGKILL at the deadline
    DUMPING_STACKS = "dumping stacks"  # hang verdict: SIGUSR1 sent; SIGTERM at the deadline
    TERMINATING = "terminating"  # SIGTERM sent to every group; SIGKILL at the deadline
    KILLING = "killing"  # SIGKILL sent; given up at the deadline (a process in uninterruptible sleep)
    DRAINING = "draining"  # no worker left; reading what is still in the pipes
    DONE = "done"


# Phases from which the loop only moves on (a teardown never goes back to a gentler signal).
_TEARDOWN_ORDER = [Phase.DUMPING_TRACES, Phase.DUMPING_STACKS, Phase.STOPPING, Phase.TERMINATING, Phase.KILLING, Phase.DRAINING, Phase.DONE]


class Supervision:
    def __init__(self, workers: list[WorkerProcess], router: LogRouter, monitor: Heartbeats,
                 metrics: MetricsSink, grace_period: float, finish_window: float,
                 on_cause: Callable[[RootCause], None] | None = None, trace_dir: Path | None = None) -> None:
        """`on_cause`: told this node's root cause the moment it is set (multi-node: the job's
        rendezvous offers it to the other nodes). `trace_dir`: where workers dump their
        collective traces when asked (None: no traces asked for)."""
        self.workers = {w.slot.rank: w for w in workers}
        self.router = router
        self.monitor = monitor
        self.metrics = metrics
        self.grace = grace_period
        self.finish_window = finish_window
        self.cause: RootCause | None = None
        self.notes: list[str] = []
        self.first_failure_at: float | None = None
        self.all_gone_at: float | None = None
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        self._signals: list[int] = []
        self._fatal: queue.SimpleQueue[FatalCause] = queue.SimpleQueue()
        self._sel = selectors.DefaultSelector()
        self._status_pending: dict[int, bytes] = {}
        self._reap_due = True
        self._last_reap = 0.0
        self._last_check = 0.0
        self._interrupts = 0
        self._terminations = 0
        self.phase = Phase.RUNNING
        self.deadline: float | None = None  # when the phase's wait is over
        self._early_exiter: WorkerProcess | None = None  # FINISHING: the rank that exited 0 first
        self._old_handlers: dict[int, object] = {}
        self._helpers: list[tuple[str, subprocess.Popen, Callable[[], str]]] = []
        self._old_wakeup = -1
        self._remote: queue.SimpleQueue[RootCause] = queue.SimpleQueue()
        self._on_cause = on_cause
        self.stop_signal: int | None = None  # the supervisor itself was asked to stop (never restart then)
        self.trace_dir = trace_dir
        self._trace_waiting: set[int] = set()  # DUMPING_TRACES: the ranks expected to answer

    # ------------------------------------------------------------------ setup

    def watch_helper(self, name: str, proc: subprocess.Popen, why: Callable[[], str]) -> None:
        """A process the run needs (the rendezvous store): its death while workers run ends the run."""
        self._helpers.append((name, proc, why))

    def add_worker(self, w: WorkerProcess) -> None:
        self.workers[w.slot.rank] = w
        self.monitor.ranks[w.slot.rank].spawned = w.started
        self.monitor.watch_pid(w.slot.rank, w.pid)

    def install_signal_handlers(self) -> None:
        """Before the first spawn: a SIGCHLD or Ctrl-C from then on is never missed."""
        def on_signal(signum: int, _frame: object) -> None:
            self._signals.append(signum)

        for sig in HANDLED_SIGNALS:
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

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake already

    # ------------------------------------------------------------------ the loop

    def run(self) -> RootCause | None:
        for rank, w in self.workers.items():
            self._sel.register(w.popen.stdout.fileno(), selectors.EVENT_READ, (rank, STDOUT))
            self._sel.register(w.popen.stderr.fileno(), selectors.EVENT_READ, (rank, STDERR))
            self._sel.register(w.status_fd, selectors.EVENT_READ, (rank, "status"))
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        while True:
            now = time.monotonic()
            for key, _ in self._sel.select(self._timeout(now)):
                if key.data is None:
                    self._drain_wakeups()
                else:
                    self._read(key.fd, *key.data)
            now = time.monotonic()
            self._handle_signals(now)
            self._handle_fatal(now)
            if self._reap_due or now - self._last_reap > 0.5:
                self._reap(now)
            self._timers(now)
            self.router.tick(now)
            if self.phase is Phase.DONE:
                break
        self._close_remaining_streams()
        if self.cause is not None and self.cause.node is None and self.cause.rank in self.router.logs:
            # a cause of this node's, now that every pipe is drained
            tail = self.router.logs[self.cause.rank].stderr_tail
            self.cause.stderr_tail = [line.decode(errors="replace") for line in tail]
        return self.cause

    def _timeout(self, now: float) -> float:
        deadlines = [now + 0.5]
        for d in (self.deadline, self.router.next_deadline()):
            if d is not None:
                deadlines.append(d)
        return max(0.0, min(deadlines) - now)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _read(self, fd: int, rank: int, stream: int | str, limit: int | None = 8) -> None:
        """Read what is there; `limit` chunks at most so one flooding worker cannot starve the others."""
        now = time.monotonic()
        reads = 0
        while limit is None or reads < limit:
            reads += 1
            try:
                data = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                return
            if not data:
                self._close_stream(fd, rank, stream, now)
                return
            if stream == "status":
                self._status(rank, data, now)
            else:
                self.router.feed(rank, stream, data, now)
            if len(data) < READ_CHUNK:
                return

    def _close_stream(self, fd: int, rank: int, stream: int | str, now: float) -> None:
        self._sel.unregister(fd)
        if stream == "status":
            os.close(fd)
        else:
            self.router.finish(rank, stream, now)
            w = self.workers[rank]
            (w.popen.stdout if stream == STDOUT else w.popen.stderr).close()

    def _close_remaining_streams(self) -> None:
        now = time.monotonic()
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                self._read(key.fd, *key.data, limit=None)  # whatever is already in the pipe
                if key.fd in self._sel.get_map():
                    self._close_stream(key.fd, *key.data, now)
        self._sel.close()

    def _status(self, rank: int, data: bytes, now: float) -> None:
        data = self._status_pending.pop(rank, b"") + data
        *lines, rest = data.split(b"\n")
        if rest:
            self._status_pending[rank] = rest
        good = []
        for line in lines:
            record = decode(line)
            if record is None:
                continue
            self.monitor.record(rank, record, now)
            good.append(line)
        if good:
            self.metrics.write_lines(b"\n".join(good) + b"\n")

    # ------------------------------------------------------------------ events

    def _handle_signals(self, now: float) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGCHLD:
                self._reap_due = True
            elif signum == signal.SIGINT:
                self._interrupts += 1
                self.stop_signal = self.stop_signal or signum
                if self._interrupts == 1 and self.cause is None:
                    logger.warning("Ctrl-C: asking every worker to stop at a step boundary (they may save a "
                                   f"checkpoint) within {self.grace:g} s; press Ctrl-C again to kill them now")
                    self._set_cause(RootCause("interrupted", ExitCode.SIGINT, "interrupted by Ctrl-C (SIGINT)"), now)
                    self._stop_all(now)
                else:
                    logger.warning("Ctrl-C again: killing every worker now")
                    if self.cause is None:
                        self._set_cause(RootCause("interrupted", ExitCode.SIGINT, "interrupted by Ctrl-C (SIGINT)"), now)
                    self._kill_all(now)
            else:
                self._terminations += 1
                self.stop_signal = self.stop_signal or signum
                name = signal.Signals(signum).name
                if self._terminations == 1 and self.cause is None:
                    logger.warning(f"supervisor received {name}: stopping every worker")
                    self._set_cause(RootCause("terminated", 128 + signum, f"the supervisor received {name}"), now)
                    self._terminate_all(now)
                elif self._terminations > 1:
                    self._kill_all(now)

    def _handle_fatal(self, now: float) -> None:
        while not self._remote.empty():
            remote = self._remote.get()
            if self.cause is None:
                self.cause = remote  # not offered back: it came from the store
                self.first_failure_at = now
                if remote.kind == "interrupted":  # Ctrl-C on another node: stop gracefully here too, so the
                    # ranks agree on a last step and save the checkpoint together
                    logger.warning(f"{remote.message}: asking this node's workers to stop at a step boundary")
                    self._stop_all(now)
                else:
                    logger.error(f"the job failed on another node: {remote.message}; stopping this node's workers")
                    self._terminate_all(now)
        while not self._fatal.empty():
            fatal = self._fatal.get()
            if self.cause is not None:
                self.notes.append(f"also reported after the root cause: {fatal.name}: {fatal.message}")
                continue
            w = self.workers.get(fatal.rank) if fatal.rank is not None else None
            logger.error(f"{fatal.name}: {fatal.message}")
            self._set_cause(RootCause("watcher", int(fatal.exit_code), f"{fatal.name}: {fatal.message}",
                                      rank=fatal.rank, device=w.slot.tag if w else None), now)
            self._terminate_all(now)

    def _reap(self, now: float) -> None:
        self._reap_due, self._last_reap = False, now
        for w in self._alive():
            if w.poll() is not None:
                self._on_exit(w, now)
        if self.all_gone_at is None and not self._alive():
            self.all_gone_at = now
            self._enter(Phase.DRAINING, now, DRAIN_WAIT)
        for name, proc, why in list(self._helpers):
            if proc.poll() is not None:
                self._helpers.remove((name, proc, why))
                if self.cause is None and self._alive():
                    message = why() or f"the {name} exited with code {proc.returncode}"
                    logger.error(message)
                    self._set_cause(RootCause("supervisor", ExitCode.FAILURE, message), now)
                    self._terminate_all(now)

    def _drain(self, w: WorkerProcess) -> None:
        """A dead worker's last words are already in its pipes: read them before judging it
        (its 'done' record, the traceback for the root-cause block)."""
        for key in list(self._sel.get_map().values()):
            if key.data is not None and key.data[0] == w.slot.rank:
                self._read(key.fd, *key.data, limit=1024)  # bounded: a grandchild may still be writing

    def _on_exit(self, w: WorkerProcess, now: float) -> None:
        self._drain(w)
        w.signal_group(signal.SIGKILL)  # what it forked and left behind in its group goes with it
        logger.debug(f"{w.slot.tag} (rank {w.slot.rank}, pid {w.pid}) {how_it_ended(w.returncode)}")
        if self.cause is not None:
            return
        code = shell_code(w.returncode)
        st = self.monitor.ranks[w.slot.rank]
        if code != 0:
            message = f"{w.slot.tag} (rank {w.slot.rank}) {how_it_ended(w.returncode)} after {now - w.started:.1f} s"
            if st.error:
                message += f": {st.error}"
            self._set_cause(self._worker_cause("worker-exit", code, message, w), now)
            self._terminate_all(now)
            return
        others = [o for o in self._alive() if o is not w]
        if not others or st.done:
            return
        names = ", ".join(str(o.slot.rank) for o in others)
        if st.records or self.monitor.expect:
            self._diagnose(self._worker_cause(
                "early-exit", ExitCode.HANG,
                f"{w.slot.tag} (rank {w.slot.rank}) exited 0 at {st.describe()} without reporting 'done' while "
                f"rank(s) {names} were still training; steps reached: {self.monitor.steps_reached()}", w), now)
        elif self.phase is Phase.RUNNING:
            self._early_exiter = w
            self._enter(Phase.FINISHING, now, self.finish_window)
            logger.debug(f"{w.slot.tag} (rank {w.slot.rank}) exited 0; waiting up to {self.finish_window:g} s "
                        f"for rank(s) {names} to finish")

    def _timers(self, now: float) -> None:
        if self.cause is None and now - self._last_check >= 0.25:
            self._last_check = now
            alive = {w.slot.rank for w in self._alive()}
            verdict = self.monitor.check(now, alive)
            if verdict is not None:
                code = ExitCode.RENDEZVOUS if verdict.kind == "rendezvous" else ExitCode.HANG
                cause = self._worker_cause(verdict.kind, code, verdict.message, self.workers[verdict.rank])
                cause.evidence = list(verdict.evidence)
                self._diagnose(cause, now)
        if self.phase is Phase.DUMPING_TRACES and traces.answered(self.trace_dir, self._trace_waiting) \
                == self._trace_waiting:
            self._traces_in(now)
        if self.phase is Phase.DRAINING and not any(k.data is not None for k in self._sel.get_map().values()):
            self._enter(Phase.DONE, now)
        if self.deadline is not None and now >= self.deadline:
            self._deadline_passed(now)

    # ------------------------------------------------------------------ the state machine

    def _enter(self, phase: Phase, now: float, wait: float | None = None) -> None:
        self.phase = phase
        self.deadline = None if wait is None else now + wait

    def _deadline_passed(self, now: float) -> None:
        """What each phase does when its wait is over: the transitions of the module docstring."""
        if self.phase is Phase.FINISHING:
            w = self._early_exiter
            names = ", ".join(str(o.slot.rank) for o in self._alive())
            self._diagnose(self._worker_cause(
                "early-exit", ExitCode.HANG,
                f"{w.slot.tag} (rank {w.slot.rank}) exited 0 but rank(s) {names} did not finish within "
                f"{self.finish_window:g} s (stuck waiting for it?)", w), now)
        elif self.phase is Phase.DUMPING_TRACES:
            self._traces_in(now)
        elif self.phase is Phase.DUMPING_STACKS:
            self._terminate_all(now)
        elif self.phase in (Phase.STOPPING, Phase.TERMINATING):
            left = self._alive()
            if left:
                logger.warning(f"grace period over: SIGKILL to {', '.join(w.slot.tag for w in left)}")
            self._kill_all(now)
        elif self.phase is Phase.KILLING:
            self.notes.append(f"some worker did not die within {KILL_WAIT:g} s of SIGKILL (uninterruptible sleep?)")
            self._enter(Phase.DONE, now)
        elif self.phase is Phase.DRAINING:
            self._enter(Phase.DONE, now)

    def _escalate(self, phase: Phase, now: float, wait: float | None) -> bool:
        """Move on to a harsher teardown phase; never back to a gentler one (False then)."""
        if self.phase in _TEARDOWN_ORDER and _TEARDOWN_ORDER.index(self.phase) >= _TEARDOWN_ORDER.index(phase):
            return False
        self._enter(phase, now, wait)
        return True

    # ------------------------------------------------------------------ actions

    def _alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers.values() if w.alive]

    def _set_cause(self, cause: RootCause, now: float) -> None:
        self.cause = cause
        self.first_failure_at = now
        if self._on_cause is not None:
            self._on_cause(cause)

    def _worker_cause(self, kind: str, code: int, message: str, w: WorkerProcess) -> RootCause:
        log = self.router.logs[w.slot.rank]
        return RootCause(kind, int(code), message, rank=w.slot.rank, device=w.slot.tag,
                         stderr_tail=[line.decode(errors="replace") for line in log.stderr_tail])

    def _diagnose(self, cause: RootCause, now: float) -> None:
        """A hang: ask every live worker for its collective trace and its Python stacks, then tear down."""
        logger.error(cause.message)
        self._set_cause(cause, now)
        responsive = self.monitor.responsive(now, {w.slot.rank for w in self._alive()})
        if self.trace_dir is not None and responsive:
            traces.request(self.trace_dir)
            self._trace_waiting = responsive
            self._escalate(Phase.DUMPING_TRACES, now, traces.WAIT_S)
            return
        self._dump_stacks(now)

    def _traces_in(self, now: float) -> None:
        """The collective traces are in (or their wait is over): one line per rank, then the stacks."""
        lines = traces.analyse(self.trace_dir, sorted(self.workers))
        for line in lines:
            logger.error(line)
        if self.cause is not None:
            self.cause.evidence += lines
        self._dump_stacks(now)

    def _dump_stacks(self, now: float) -> None:
        asked, cannot = [], []
        for w in self._alive():
            if w.catches(signal.SIGUSR1):
                w.signal_leader(signal.SIGUSR1)
                asked.append(w.slot.tag)
            else:
                cannot.append(w.slot.tag)
        if asked:
            logger.info(f"asked {', '.join(asked)} for their Python stacks (SIGUSR1); they go to the worker logs")
        if cannot:
            self.notes.append(f"{', '.join(cannot)} installed no SIGUSR1 handler, so no stack dump; add "
                              "`faulthandler.register(signal.SIGUSR1)` to the script to get one")
        self._escalate(Phase.DUMPING_STACKS, now, min(STACK_DUMP_WAIT, self.grace) if asked else 0.0)

    def _stop_all(self, now: float) -> None:
        """Graceful: SIGINT to each worker's leader; they stop at a step boundary and may save."""
        for w in self._alive():
            w.signal_leader(signal.SIGINT)
        self._escalate(Phase.STOPPING, now, self.grace)

    def _terminate_all(self, now: float) -> None:
        for w in self._alive():  # signals only: no waiting between workers
            w.signal_group(signal.SIGTERM)
            w.signal_group(signal.SIGCONT)
        self._escalate(Phase.TERMINATING, now, self.grace)

    def _kill_all(self, now: float) -> None:
        for w in self._alive():
            w.signal_group(signal.SIGKILL)
        self._escalate(Phase.KILLING, now, KILL_WAIT)
        self._reap_due = True

    def force_kill_everything(self) -> None:
        """Last resort on a supervisor bug: no worker may outlive us."""
        for w in self.workers.values():
            w.signal_group(signal.SIGKILL)
            w.poll()


