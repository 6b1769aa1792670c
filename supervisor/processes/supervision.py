"""The event loop of a running job: forward logs, read heartbeats, notice deaths, tear down.

One thread, one epoll: worker pipes (stdout, stderr, status), and a wake-up pipe
that signal handlers (SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGCONT)
and watcher threads write to. A death is seen the moment SIGCHLD arrives, not at the
next poll tick. After the supervisor itself was stopped (SIGCONT, or any gap in the
loop over LOOP_GAP), every pipe is read to the end and the hang clocks restart before
anyone is judged.

The loop's phase (`Phase`) says what it is waiting for; each phase but RUNNING has
one deadline (FINISHING only while a rank without heartbeats is left), and
`_deadline_passed` is the one place that says what comes next:

    RUNNING --a rank exits 0 early--> FINISHING --the others stop progressing--> DUMPING_TRACES
    RUNNING/FINISHING --hang verdict--> DUMPING_TRACES --every responsive rank dumped its
        collective trace, or traces.WAIT_S--> DUMPING_STACKS --stacks written--> TERMINATING
    any live phase --failure, watcher--> TERMINATING --grace over--> KILLING
    RUNNING --Ctrl-C--> STOPPING (workers save, exit 130) --grace over, no save going on--> KILLING
    RUNNING --SIGTERM/SIGHUP/SIGUSR1/SIGUSR2--> STOPPING (save, exit 143) --stop timeout--> KILLING
        (a --script: TERMINATING with the stop timeout; SIGUSR1/2 are forwarded to it instead)
    any --Ctrl-C again / SIGTERM again--> KILLING --KILL_WAIT--> DONE (a note: D-state?)
    any --no worker left--> DRAINING --pipes closed or DRAIN_WAIT--> DONE

A rank that exits 0 while others run is finished, not failed (FINISHING): the others
may end at their own pace. Ranks with heartbeats are judged by them as before (a rank
saving a checkpoint, and the ranks waiting for it, get the long allowance); a rank that
never sent one makes it a hang when the hang timeout after the clean exit is over.

Teardown: the teardown signal (gpuherd's worker: TEARDOWN_SIGNAL, which only the supervisor
sends; a --script: SIGTERM) (+ SIGCONT, so a stopped worker can act on it) to every worker's
process group at once, then SIGKILL what is left after the grace period (or later, up to
the stop timeout, while a rank still writes a checkpoint in the background: it finishes
that write before it exits, and a restart can resume from it). A graceful
stop (stopping.py) never SIGKILLs a worker while it reports phase `checkpoint`, up to
the stop timeout; a save it did have to cut is named in `graceful.unfinished`. The
exit code is the root cause's: the first failing worker's own code, 124 for a hang or
an early clean exit the others then hung on, 5 for a process group that never formed, a watcher's code, 130
for Ctrl-C, 128+N when the supervisor itself got SIGTERM/SIGHUP, 143 for SIGUSR1/2.
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
from supervisor.output import STDERR, STDOUT, LogRouter
from supervisor.processes.error_file import error_file_for, read_error_file
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.signal_rules import inherited_ignored
from supervisor.processes.spawn import WorkerProcess
from supervisor.processes.stopping import STOP_REQUESTS, GracefulStop, StopRules, stop_exit_code
from supervisor.summary import RootCause, how_it_ended, shell_code

READ_CHUNK = 1 << 16
STACK_DUMP_WAIT = 2.0  # after the stacks signal, time for faulthandler's stacks to reach the logs
KILL_WAIT = 10.0  # after SIGKILL: a process in uninterruptible sleep (a wedged driver) may linger
DRAIN_WAIT = 2.0  # after the last worker: pipes a setsid'd grandchild still holds are given up
EARLY_EXIT_NOTICE = 2.0  # a rank exited 0 and the others still run this much later: say so (INFO)
LOOP_GAP = 1.0  # the loop slept this much longer than it asked to: the supervisor was stopped
CATCH_UP_CHUNKS = 256  # per pipe after a stop: 16 MiB, so a flooding worker cannot hold the loop
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGCHLD, signal.SIGCONT, *STOP_REQUESTS)


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


# Phases from which the loop only moves on (a teardown never goes back to a gentler signal).
_TEARDOWN_ORDER = [Phase.DUMPING_TRACES, Phase.DUMPING_STACKS, Phase.STOPPING, Phase.TERMINATING, Phase.KILLING, Phase.DRAINING, Phase.DONE]


class Supervision:
    def __init__(self, workers: list[WorkerProcess], router: LogRouter, monitor: Heartbeats,
                 metrics: MetricsSink, stop: StopRules, finish_window: float,
                 on_cause: Callable[[RootCause], None] | None = None,
                 on_record: Callable[[dict], None] | None = None, script: bool = False,
                 unwatched_why: str | None = None, trace_dir: Path | None = None,
                 live: LiveRecovery | None = None) -> None:
        """`on_cause`: told this node's root cause the moment it is set (multi-node: the job's
        rendezvous offers it to the other nodes). `on_record`: every status record, as it comes.
        `finish_window`: how long the ranks left after a clean early exit may go without
        progress. `script`: the workers run a user's script, whose exit codes are its own.
        `unwatched_why`: said once for ranks that never send a heartbeat. `trace_dir`: where
        workers dump their collective traces when asked (None: no traces asked for). `live`: a lost
        rank may be replaced by a warm spare instead of ending the attempt (live_recovery.py)."""
        self.workers = {w.slot.rank: w for w in workers}
        self.router = router
        self.monitor = monitor
        self.metrics = metrics
        self.stop = stop
        self.grace = stop.grace
        self.finish_window = finish_window
        self.script = script
        self.unwatched_why = unwatched_why
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
        self._early_exit_told = False
        self._old_handlers: dict[int, object] = {}
        self._helpers: list[tuple[str, subprocess.Popen, Callable[[], str]]] = []
        self._old_wakeup = -1
        self._remote: queue.SimpleQueue[RootCause] = queue.SimpleQueue()
        self._on_cause = on_cause
        self._on_record = on_record
        self.stop_signal: int | None = None  # the supervisor itself was asked to stop (never restart then)
        self.graceful: GracefulStop | None = None  # a graceful stop, once one began
        self._stopped_meanwhile = False  # SIGCONT: the supervisor itself was stopped
        self.trace_dir = trace_dir
        self._trace_waiting: set[int] = set()  # DUMPING_TRACES: the ranks expected to answer
        self.live = live
        self._condemned: dict[int, RootCause] = {}  # hung ranks killed for a live recovery: their verdict
        self._writes_told = False  # a teardown waits for a background checkpoint write (said once)

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
            before = time.monotonic()
            timeout = self._timeout(before)
            for key, _ in self._sel.select(timeout):
                if key.data is None:
                    self._drain_wakeups()
                else:
                    self._read(key.fd, *key.data)
            now = time.monotonic()
            self._handle_signals(now)
            if self._stopped_meanwhile or now - before > timeout + LOOP_GAP:
                self._catch_up()
                now = time.monotonic()
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

    def _catch_up(self) -> None:
        """The supervisor was stopped (or starved) while the workers went on: what they said
        meanwhile is still in the pipes. Read it all, then count silence from now only."""
        self._stopped_meanwhile = False
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                self._read(key.fd, *key.data, limit=CATCH_UP_CHUNKS)
        self.monitor.restart_clocks(time.monotonic())

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
            if record.get("type") == "stop":
                self._worker_stop(rank, str(record.get("signal")), now)
            if self._on_record is not None:
                self._on_record(record)
            good.append(line)
        if good:
            self.metrics.write_lines(b"\n".join(good) + b"\n")

    # ------------------------------------------------------------------ events

    def _handle_signals(self, now: float) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGCHLD:
                self._reap_due = True
            elif signum == signal.SIGCONT:
                self._stopped_meanwhile = True
            elif signum == signal.SIGINT:
                self._interrupt(now)
            elif signum in (signal.SIGUSR1, signal.SIGUSR2) and self.stop.save_signal is None:
                self._forward(signum)  # a --script's own business (Lightning's SLURM requeue, say)
            else:
                self._stop_request(signum, now)

    def _interrupt(self, now: float) -> None:
        self._interrupts += 1
        self.stop_signal = self.stop_signal or signal.SIGINT
        if self._interrupts == 1 and self.cause is None:
            logger.warning(f"Ctrl-C: asking every worker to stop at a step boundary and save a checkpoint "
                           f"within {self.grace:g} s (longer while a checkpoint is being written, up to "
                           f"{self.stop.stop_timeout:g} s); press Ctrl-C again to kill them now")
            self._set_cause(RootCause("interrupted", ExitCode.SIGINT, "interrupted by Ctrl-C (SIGINT)"), now)
            self._stop_all(now)
            return
        logger.warning(f"Ctrl-C {'again' if self._interrupts > 1 else 'during the teardown'}: killing every worker now")
        if self.cause is None:
            self._set_cause(RootCause("interrupted", ExitCode.SIGINT, "interrupted by Ctrl-C (SIGINT)"), now)
        self._kill_all(now)

    def _stop_request(self, signum: int, now: float) -> None:
        """SIGTERM/SIGHUP (scancel, a preemption, a closed terminal) or, for gpuherd's worker,
        SIGUSR1/SIGUSR2 (SLURM's warning before the time limit): save and stop. A second
        SIGTERM/SIGHUP kills; a later SIGUSR1/2 changes nothing."""
        name = signal.Signals(signum).name
        self.stop_signal = self.stop_signal or signum
        repeated = signum in (signal.SIGTERM, signal.SIGHUP) and self._terminations > 0
        if signum in (signal.SIGTERM, signal.SIGHUP):
            self._terminations += 1
        if self.cause is None:  # the workers first: naming the cause may ask SLURM (a second or so)
            self._save_and_stop(now, f"supervisor received {name}")
            self._set_cause(RootCause("terminated", stop_exit_code(signum), f"the supervisor received {name}"), now)
        elif repeated:
            logger.warning(f"{name} again: killing every worker now")
            self._kill_all(now)

    def _worker_stop(self, rank: int, name: str, now: float) -> None:
        """A stop signal reached a worker itself (SLURM signals every process of a step; or a
        `kill` aimed at one worker): the same save and stop as the supervisor's own, for every
        worker, every node. Never a kill: only the supervisor's own signals count as repeated."""
        if self.cause is not None:
            return
        w = self.workers.get(rank)
        who = f"{w.slot.tag} (rank {rank})" if w is not None else f"rank {rank}"
        code = ExitCode.SIGINT if name == "SIGINT" else ExitCode.SIGTERM
        if name in signal.Signals.__members__:
            self.stop_signal = self.stop_signal or signal.Signals[name]
        if code == ExitCode.SIGINT:
            self._stop_all(now)
        else:
            self._save_and_stop(now, f"{who} received {name}")
        self._set_cause(RootCause("interrupted" if code == ExitCode.SIGINT else "terminated", code,
                                  f"{who} received {name}"), now)

    def _forward(self, signum: int) -> None:
        """Pass SIGUSR1/SIGUSR2 on to every worker that handles it (to one that does not, its
        default action would be death)."""
        sent, skipped = [], []
        for w in self._alive():
            if w.catches(signum):
                w.signal_leader(signum)
                sent.append(w.slot.tag)
            else:
                skipped.append(w.slot.tag)
        logger.info(f"supervisor received {signal.Signals(signum).name}: forwarded to {', '.join(sent) or 'no worker'}"
                    + (f"; not to {', '.join(skipped)}, which installed no handler for it" if skipped else ""))

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
                elif remote.kind in ("terminated", "membership"):  # the same for a stop request (a preemption)
                    self._save_and_stop(now, remote.message)  # there, and for a node asking to join (elastic)
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
        logger.debug(f"{w.slot.tag} (rank {w.slot.rank}, pid {w.pid}) {how_it_ended(w.returncode, self.script)}")
        if self.cause is not None:
            self._judge_stop(w)
            return
        code = shell_code(w.returncode)
        st = self.monitor.ranks[w.slot.rank]
        if code != 0:
            self._worker_failed(w, code, now)
            return
        others = [o for o in self._alive() if o is not w]
        if not others or st.done or self.phase is not Phase.RUNNING:
            return
        self._early_exiter = w
        self._enter(Phase.FINISHING, now, min(EARLY_EXIT_NOTICE, self.finish_window))

    def _worker_failed(self, w: WorkerProcess, code: int, now: float) -> None:
        """The root cause: its own account first (torch's @record error file), else its status record."""
        message = (f"{w.slot.tag} (rank {w.slot.rank}) {how_it_ended(w.returncode, self.script)} "
                   f"after {now - w.started:.1f} s")
        error = read_error_file(error_file_for(w.log_path))
        st_error = self.monitor.ranks[w.slot.rank].error
        if error is not None or st_error:
            message += f": {error.message if error is not None else st_error}"
        cause = self._condemned.pop(w.slot.rank, None) or self._worker_cause("worker-exit", code, message, w)
        cause.script_code = self.script and w.returncode > 0  # a signal's death is nobody's own code
        if error is not None:
            cause.traceback = error.traceback
        if self._replaced_live(w, cause, now):
            return
        self._set_cause(cause, now)
        self._terminate_all(now)

    def _finish_check(self, now: float) -> None:
        """FINISHING's deadline. Ranks that send heartbeats are judged by them (`_judge_heartbeats`:
        a saving rank has the long allowance, and so have ranks waiting for it); ranks that never
        sent one make it a hang once the finish window after the clean exit is over."""
        w = self._early_exiter
        if not self._early_exit_told:
            self._early_exit_told = True
            where = self.monitor.ranks[w.slot.rank].describe()
            logger.info(f"{w.slot.tag} (rank {w.slot.rank}) exited 0 first ({where}); rank(s) "
                        f"{', '.join(str(o.slot.rank) for o in self._alive())} may finish at their own pace: "
                        f"a hang only after {self.finish_window:g} s without progress")
        silent = [str(o.slot.rank) for o in self._alive()
                  if not (self.monitor.ranks[o.slot.rank].records or self.monitor.expect)]
        if not silent or now - w.ended < self.finish_window:
            self.deadline = w.ended + self.finish_window if silent else None
            return
        self._diagnose(self._worker_cause(
            "early-exit", ExitCode.HANG,
            f"{w.slot.tag} (rank {w.slot.rank}) exited 0, then rank(s) {', '.join(silent)} made no progress for "
            f"{self.finish_window:g} s (stuck waiting for it?)", w), now)

    def _timers(self, now: float) -> None:
        if self.cause is None and now - self._last_check >= 0.25:
            self._last_check = now
            self._judge_live_recovery(now)  # first: a survivor stuck in the broken group is no hang of its own
            if self.cause is None:
                self._judge_heartbeats(now)
        if self.phase is Phase.DUMPING_TRACES and traces.answered(self.trace_dir, self._trace_waiting) \
                == self._trace_waiting:
            self._traces_in(now)
        if self.phase is Phase.DRAINING and not any(k.data is not None for k in self._sel.get_map().values()):
            self._enter(Phase.DONE, now)
        if self.deadline is not None and now >= self.deadline:
            self._deadline_passed(now)

    def _judge_heartbeats(self, now: float) -> None:
        alive = {w.slot.rank for w in self._alive()}
        unwatched = self.monitor.newly_unwatched(now, alive)
        if unwatched and self.unwatched_why:
            logger.info(f"rank(s) {', '.join(map(str, unwatched))} sent no heartbeat in their first "
                        f"{self.monitor.timeouts.allowance('startup'):g} s: {self.unwatched_why}")
        verdict = self.monitor.check(now, alive)
        if verdict is None:
            return
        code = ExitCode.RENDEZVOUS if verdict.kind == "rendezvous" else ExitCode.HANG
        message = verdict.message
        if self._early_exiter is not None and self._early_exiter.ended is not None:
            message += (f"; {self._early_exiter.slot.tag} (rank {self._early_exiter.slot.rank}) had exited 0 "
                        f"{now - self._early_exiter.ended:.0f} s before (waiting for it?)")
        cause = self._worker_cause(verdict.kind, code, message, self.workers[verdict.rank])
        cause.evidence = list(verdict.evidence)
        if verdict.kind == "hang" and self._condemn(self.workers[verdict.rank], cause):
            return
        self._diagnose(cause, now)

    # ------------------------------------------------------------------ live recovery (live_recovery.py)

    def _condemn(self, w: WorkerProcess, cause: RootCause) -> bool:
        """A hung rank a spare can replace: killed now, and replaced when it is reaped."""
        if w.slot.rank in self._condemned:
            return True  # killed already, not reaped yet
        if self.live is None or self.live.why_not(
                w.slot.rank, [o.slot.rank for o in self._alive() if o is not w]) is not None:
            return False
        logger.error(f"{cause.message}; SIGKILL to {w.slot.tag} (rank {w.slot.rank}) for a live recovery")
        self._condemned[w.slot.rank] = cause
        w.signal_group(signal.SIGKILL)
        self._reap_due = True
        return True

    def _judge_live_recovery(self, now: float) -> None:
        """A survivor that never left the broken group's collective ends the attempt (a restart)."""
        stuck = self.live.stuck(now, self.monitor.timeouts.allowance("step")) if self.live is not None else None
        if stuck is None:
            return
        message, rank = stuck
        logger.error(message)
        cause = self._worker_cause("hang", ExitCode.HANG, message, self.workers[rank])
        self.live.give_up(cause)
        self._set_cause(cause, now)
        self._terminate_all(now)

    def _replaced_live(self, w: WorkerProcess, cause: RootCause, now: float) -> bool:
        """A warm spare takes the lost rank: its pipes are read as the rank's from now on."""
        if self.live is None or self.cause is not None:
            return False
        new = self.live.replace(w, cause, [o for o in self._alive() if o is not w], now)
        if new is None:
            return False
        rank = w.slot.rank
        for key in list(self._sel.get_map().values()):  # the dead worker's pipes, drained already
            if key.data is not None and key.data[0] == rank:
                self._close_stream(key.fd, *key.data, now)
        self.workers[rank] = new
        self.monitor.rejoin(rank, new.pid, now)
        self._sel.register(new.popen.stdout.fileno(), selectors.EVENT_READ, (rank, STDOUT))
        self._sel.register(new.popen.stderr.fileno(), selectors.EVENT_READ, (rank, STDERR))
        self._sel.register(new.status_fd, selectors.EVENT_READ, (rank, "status"))
        return True

    # ------------------------------------------------------------------ the state machine

    def _enter(self, phase: Phase, now: float, wait: float | None = None) -> None:
        self.phase = phase
        self.deadline = None if wait is None else now + wait

    def _deadline_passed(self, now: float) -> None:
        """What each phase does when its wait is over: the transitions of the module docstring."""
        if self.phase is Phase.FINISHING:
            self._finish_check(now)
        elif self.phase is Phase.DUMPING_TRACES:
            self._traces_in(now)
        elif self.phase is Phase.DUMPING_STACKS:
            self._terminate_all(now)
        elif self.phase is Phase.STOPPING and self._extend_for_saves(now):
            pass
        elif self.phase is Phase.TERMINATING and self._wait_for_writes(now):
            pass
        elif self.phase in (Phase.STOPPING, Phase.TERMINATING):
            left = self._alive()
            if left:
                over = "stop timeout" if self.graceful and now >= self.graceful.limit else "grace period"
                logger.warning(f"{over} over: SIGKILL to {', '.join(w.slot.tag for w in left)}")
                self._note_cut_saves(left)
                self._note_cut_writes(left)
            self._kill_all(now)
        elif self.phase is Phase.KILLING:
            self.notes.append(f"some worker did not die within {KILL_WAIT:g} s of SIGKILL (uninterruptible sleep?)")
            self._enter(Phase.DONE, now)
        elif self.phase is Phase.DRAINING:
            self._enter(Phase.DONE, now)

    def _extend_for_saves(self, now: float) -> bool:
        """A graceful stop's grace is over: while a worker still writes its checkpoint (and
        for a grace period after its save), wait on, up to the stop timeout."""
        if self.graceful is None:
            return False
        alive = [self.monitor.ranks[w.slot.rank] for w in self._alive()]
        saving = [st for st in alive if st.saving or st.writing]
        ends = [st.save_ended for st in alive if st.save_ended is not None]
        deadline = self.graceful.next_deadline(now, self.grace, bool(saving), max(ends, default=None))
        if deadline is None:
            return False
        if saving and not self.graceful.extended:
            self.graceful.extended = True
            logger.info(f"rank(s) {', '.join(str(st.rank) for st in saving)} still saving a checkpoint: waiting for "
                        f"it (at most {self.graceful.limit - now:.0f} s more, the stop timeout)")
        self.deadline = deadline
        return True

    def _wait_for_writes(self, now: float) -> bool:
        """A teardown's grace is over: a rank still writing a checkpoint in the background
        (worker/saver.py: it finishes that write before it exits) gets the time, up to the
        stop timeout after the failure, so a restart can resume from it."""
        writing = [w for w in self._alive() if self.monitor.ranks[w.slot.rank].writing]
        limit = (self.first_failure_at or now) + self.stop.stop_timeout
        if not writing or now >= limit:
            return False
        if not self._writes_told:
            self._writes_told = True
            logger.info(f"{', '.join(w.slot.tag for w in writing)} still writing a checkpoint in the background: "
                        f"waiting for it (at most {limit - now:.0f} s more, the stop timeout)")
        self.deadline = min(limit, now + self.grace)
        return True

    def _note_cut_writes(self, left: list[WorkerProcess]) -> None:
        for w in left:
            if (path := self.monitor.ranks[w.slot.rank].writing) is not None:
                self.notes.append(f"{w.slot.tag} (rank {w.slot.rank}) was killed while writing {Path(path).name} "
                                  "in the background: it never became a checkpoint (--resume takes an older one)")

    def _note_cut_saves(self, left: list[WorkerProcess]) -> None:
        """Workers about to be killed in a graceful stop: whose final save does that cut?
        (gpuherd's worker saves at every graceful stop, then says `shutdown` on its way out.)"""
        if self.graceful is None:
            return
        for w in left:
            st = self.monitor.ranks[w.slot.rank]
            self.graceful.killed(f"{w.slot.tag} (rank {w.slot.rank})", st.saving, st.phase == "shutdown",
                                 saves_always=self.stop.save_signal is not None)

    def _judge_stop(self, w: WorkerProcess) -> None:
        if self.graceful is not None and self.stop.save_signal is not None and "SIGKILL" not in w.signalled:
            self.graceful.ended(f"{w.slot.tag} (rank {w.slot.rank})", shell_code(w.returncode),
                                how_it_ended(w.returncode))

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
        stacks = self.stop.stacks_signal
        name = signal.Signals(stacks).name
        for w in self._alive():
            if w.catches(stacks):
                w.signal_leader(stacks)
                asked.append(w.slot.tag)
            else:
                cannot.append(w.slot.tag)
        if asked:
            logger.info(f"asked {', '.join(asked)} for their Python stacks ({name}); they go to the worker logs")
        if cannot:
            self.notes.append(f"{', '.join(cannot)} installed no {name} handler, so no stack dump; add "
                              f"`faulthandler.register(signal.{name})` to the script to get one")
        self._escalate(Phase.DUMPING_STACKS, now, min(STACK_DUMP_WAIT, self.grace) if asked else 0.0)

    def _stop_all(self, now: float, signum: int = signal.SIGINT, wait: float | None = None) -> None:
        """Graceful: `signum` to each worker's leader (SIGINT: Ctrl-C; the save signal: a stop
        request); they stop at a step boundary and save. A worker still starting, with no
        handler for the save signal yet, has nothing to save: it gets SIGTERM."""
        for w in self._alive():
            if signum == signal.SIGINT or w.catches(signum):
                w.signal_leader(signum)
            else:
                w.signal_group(self.stop.teardown_signal)
        self._begin_graceful(now)
        self._escalate(Phase.STOPPING, now, self.grace if wait is None else wait)

    def _save_and_stop(self, now: float, why: str) -> None:
        """A stop request: every worker finishes its step, saves and exits 143, within the stop timeout."""
        timeout = self.stop.stop_timeout
        if self.stop.save_signal is None:  # a --script: SIGTERM, as torchrun sends it, and the time to act on it
            logger.warning(f"{why}: SIGTERM to every worker, SIGKILL after {timeout:g} s (the stop timeout)")
            self._begin_graceful(now)
            self._terminate_all(now, wait=timeout)
            return
        logger.warning(f"{why}: every worker finishes its step, saves a checkpoint and stops (exit 143) "
                       f"within {timeout:g} s (the stop timeout)")
        self._stop_all(now, self.stop.save_signal, wait=timeout)

    def final_save(self) -> str | None:
        """After a graceful stop: "saved", "not saved" (see `graceful.unfinished`), or None."""
        if self.graceful is None:
            return None
        started = self.graceful.started
        saved = any(st.saved_at is not None and st.saved_at >= started for st in self.monitor.ranks.values())
        return self.graceful.outcome(saved)

    def _begin_graceful(self, now: float) -> None:
        if self.graceful is None:
            self.graceful = GracefulStop(started=now, limit=now + self.stop.stop_timeout)

    def _terminate_all(self, now: float, wait: float | None = None) -> None:
        for w in self._alive():  # signals only: no waiting between workers
            w.signal_group(self.stop.teardown_signal)
            w.signal_group(signal.SIGCONT)
        self._escalate(Phase.TERMINATING, now, self.grace if wait is None else wait)

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


