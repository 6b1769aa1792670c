"""One attempt, carried out: rendezvous -> spawn one worker per device -> supervise until the
end -> the attempt's report, nothing of it left running.

What the attempt is (its number, the checkpoint it resumes from, its devices, the live
recoveries it may do) is the attempt policy's decision (attempt_policy.py), handed over as an
`AttemptOrder`; what it ended with goes back to that policy as the `AttemptReport`. The parts
that outlive an attempt (the rendezvous, the warm store helper, the learned hang allowances,
the checkpoints this run saved) are held here for the whole job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from gpuherd import contract
from gpuherd.checkpoint_layout import remove_orphans
from gpuherd.config import Config
from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Record, Step
from supervisor import run_dir as rundir
from supervisor.cli import Launch
from supervisor.goodput import marks
from supervisor.gpus import Binding, DevicePlan, DeviceSlot
from supervisor.health import (
    Heartbeats,
    LearnedTimeouts,
    MetricsSink,
    MoveOut,
    NcclTransportWatch,
    NodeStragglers,
    RunContext,
    RunWatcher,
    Stragglers,
    SuspectWatch,
    gpu_watcher,
    mark_moved,
    remember,
)
from supervisor.output import Console, LogRouter, NodeRelay, WorkerLog
from supervisor.processes import (
    SAVE_AND_STOP,
    AttemptLive,
    LiveRecovery,
    OrphanGuard,
    RunEnv,
    SpareDesk,
    SpareNodeWorkers,
    Standbys,
    StopRules,
    Supervision,
    WorkerProcess,
    die_with_parent,
    discard_spares,
    error_file_for,
    helper_preexec,
    live_for_attempt,
    python_env,
    script_env,
    spawn,
    standby_env,
    sweep_children,
    worker_env,
)
from supervisor.rendezvous import (
    NodeLinkError,
    Rendezvous,
    Setup,
    SingleNode,
    SpareNodeUnused,
    StoreServer,
    job_info,
    slurm_stop,
)
from supervisor.restarts import Progress, RunCheckpoints
from supervisor.summary import AttemptReport, RootCause, WorkerReport, how_it_ended, now_iso, shell_code
from supervisor.torchrun import FileTimer, ScriptSaves, bound, file_timer_wanted, numa_plan, timer_fifo

TEARDOWN_NAME = signal.Signals(contract.TEARDOWN_SIGNAL).name


@dataclass(frozen=True)
class AttemptOrder:
    """The attempt the policy decided on."""

    number: int
    resume: str | None  # the checkpoint handed to the workers (GPUHERD_RESUME); None: as configured
    plan: DevicePlan  # this node's devices (without the GPUs left out as suspect)
    restart_count: int  # restarts used before it (TORCHELASTIC_RESTART_COUNT)
    live_budget: int  # live recoveries it may do (what is left of --max-restarts)
    excluded: tuple[int, ...]  # suspect GPUs it runs without
    dataset_path: str  # the built-in trainer's dataset cache ("" for a --script)


@dataclass
class Attempt:
    """One attempt's parts, built before the first spawn."""

    number: int
    setup: Setup
    logs: dict[int, WorkerLog]
    router: LogRouter
    heartbeats: Heartbeats
    sup: Supervision
    run_env: RunEnv
    metrics: MetricsSink
    stragglers: Stragglers
    suspects: SuspectWatch
    live: LiveRecovery | None = None  # warm spares and live recovery (None: off)
    workers: list[WorkerProcess] = field(default_factory=list)
    timer: FileTimer | None = None  # TORCHELASTIC_ENABLE_FILE_TIMER=1: torch's file timer server


class AttemptRunner:
    """Runs the job's attempts one at a time, and holds what they share."""

    def __init__(self, launch: Launch, run_id: str, run_dir: Path, command: list[str], console: Console,
                 stop_timeout: float, log_base: Path, timeouts: LearnedTimeouts) -> None:
        self.launch, self.cfg = launch, launch.config
        self.run_id, self.run_dir, self.command = run_id, run_dir, command
        self.console, self.stop_timeout, self.log_base = console, stop_timeout, log_base
        self.timeouts = timeouts
        self.rendezvous: Rendezvous = SingleNode()
        self.checkpoints = RunCheckpoints()
        self.progress = Progress()  # the attempt under way's
        self.script_saves = ScriptSaves(watched=launch.script is not None and launch.script.bootstrapped)  # the run's
        self.store_server = StoreServer(sys.executable, python_env(), helper_preexec())  # warm across attempts
        self._guarded: set[int] = set()  # helper processes the orphan guard already knows
        self.requeue = launch.requeue  # SLURM requeued the job this many times (SLURM_RESTART_COUNT)
        self.notes: list[str] = []  # every attempt's, for the summary
        self.stragglers: list[dict] = []  # every attempt's straggler warnings
        self.recoveries: list[dict] = []  # every live recovery of every attempt (summary.json)
        self.relay = NodeRelay(console.write)  # multi-node: lines folded and paces judged on node 0
        self.spare_desk = SpareDesk(run_dir)  # `gpuherd spare`: every attempt answers the run's requests
        self.standbys = Standbys()  # a --script's next attempt, importing torch while this one trains
        self._standbys_due: Callable[[], None] | None = None  # started at the attempt's first step
        self.spare_node_workers: SpareNodeWorkers | None = None  # a spare node's, while it stands by

    def close_folding(self) -> None:
        """The job's end: every line still held across nodes is printed (before the summary)."""
        self.relay.close()

    @property
    def mode(self) -> str:
        return "script" if self.launch.script else "train"

    def _blame_the_cache(self, cause: RootCause | None, dataset_path: str) -> RootCause | None:
        """A built-in worker killed by SIGBUS touched a page of its memory-mapped dataset cache that
        is no longer in the file: the cache was truncated under the run. Its size check names it,
        and the cause becomes a data error (exit 3; with restarts, the cache is rebuilt first)."""
        if cause is None or self.mode != "train" or not dataset_path or cause.kind != "worker-exit" \
                or cause.exit_code != 128 + signal.SIGBUS:
            return cause
        from dataset_cache import DatasetError, open_data

        try:
            open_data(Path(dataset_path))
        except DatasetError as exc:
            who = f"{cause.device} (rank {cause.rank})" if cause.device else f"rank {cause.rank}"
            message = f"{exc}: {who} was killed by SIGBUS reading it (the cache changed while the run read it)"
            logger.error(message)
            return dataclasses.replace(cause, kind="dataset", exit_code=int(ExitCode.DATA), message=message)
        return cause

    def run(self, order: AttemptOrder, guard: OrphanGuard, metrics: MetricsSink) -> AttemptReport:
        """Start every worker once, supervise them to the end, clean up everything but the job's files."""
        report = self._run(order, guard, metrics)
        report.root_cause = self._blame_the_cache(report.root_cause, order.dataset_path)
        return report

    def _run(self, order: AttemptOrder, guard: OrphanGuard, metrics: MetricsSink) -> AttemptReport:
        attempt, resume = order.number, order.resume
        started_at, t0 = now_iso(), time.monotonic()
        log_dir = self._log_dir(attempt)
        metrics.write(marks.attempt(attempt, resumed=resume is not None, script=self.mode == "script"))
        self.progress = Progress()
        self.script_saves.begin(attempt)
        if getattr(self.rendezvous, "spare", False):  # a spare node: warm workers while it stands by
            self._warm_spare_node(order, log_dir, guard)
        try:
            setup = self.rendezvous.begin(attempt, order.plan, resume)
        except NodeLinkError as exc:
            self._spare_node_done(guard)
            return self._not_started(order, exc, started_at, round(time.monotonic() - t0, 3), log_dir)
        att = self._prepare_attempt(order, setup, log_dir, metrics, guard)
        cause = _timer_cause(self._supervise(att, guard), att)
        cause = self.rendezvous.settle(attempt, cause, att.sup.notes)
        metrics.write(marks.attempt_end(attempt, cause.kind if cause else None, att.sup.state.failed_at))
        att.stragglers.close(time.monotonic())
        self.stragglers += [{**found, "attempt": attempt} for found in att.stragglers.found + att.stragglers.nodes_found]
        try:
            self.timeouts.save(self.run_dir)
        except OSError as exc:  # a full log disk: the allowances were learned all the same
            logger.warning(f"hang allowances not saved to {self.run_dir} ({exc.strerror}); the next --resume "
                           "learns them again")
        sup = att.sup
        cause, final_save = _final_save(cause, sup, self.checkpoints, self.mode, Path(self.cfg.system.checkpoint_dir))
        cause, saves = self._script_saves(cause, sup, reported_save=final_save is not None)
        self.notes += sup.notes
        recoveries = att.live.settle() if att.live is not None else []
        self.recoveries += recoveries
        att.suspects.moved_out(recoveries)  # a straggler moved out: its device is a suspect too
        suspects = att.suspects.devices(self.cfg.system.exclude_suspect_gpus)
        mark_moved(suspects, recoveries)
        remember(self.cfg.system.run_root, self.run_id, suspects)  # the list that outlives the run
        teardown = None
        if sup.state.failed_at is not None and sup.all_gone_at is not None:
            teardown = round(max(0.0, sup.all_gone_at - sup.state.failed_at), 4)
        return AttemptReport(
            attempt=attempt, started_at=started_at, duration_s=round(time.monotonic() - t0, 3),
            exit_code=int(cause.exit_code) if cause else 0, outcome="success" if cause is None else cause.kind,
            root_cause=cause, resumed_from=setup.resume, log_dir=str(log_dir), teardown_s=teardown,
            workers=[_report(w, cause, att.heartbeats, self.mode == "script") for _, w in sorted(sup.workers.items())],
            recoveries=recoveries,
            stop_signal=signal.Signals(sup.state.stop_signal).name if sup.state.stop_signal else None,
            final_save=final_save, script_saves=saves,
            suspect_devices=suspects,
            excluded_gpus=list(order.excluded))

    def _script_saves(self, cause: RootCause | None, sup: Supervision,
                      reported_save: bool) -> tuple[RootCause | None, dict | None]:
        """A --script: the last save gpuherd saw in the attempt, in words and as a record; a stop's
        outcome says whether a save followed the signal (gpuherd saves nothing for a script), unless
        the script's own status records said how its final save went (`reported_save`: the
        outcome has those words already)."""
        if self.mode != "script":
            return cause, None
        saves, stop = self.script_saves, sup.state.graceful
        signalled = stop.started if stop is not None else sup.state.failed_at  # a stop's signal (SIGQUIT: no grace)
        if cause is not None and cause.kind in marks.STOPS and signalled is not None and not reported_save:
            cause = dataclasses.replace(cause, message=f"{cause.message}; {saves.after_signal(signalled)}")
            return cause, {**saves.record(None), "said": saves.said(None)}
        until = sup.state.failed_at if cause is not None else None
        return cause, {**saves.record(until), "said": saves.said(until)}

    def _not_started(self, order: AttemptOrder, exc: NodeLinkError, started_at: str, duration_s: float,
                     log_dir: Path) -> AttemptReport:
        """No worker started: this node could not join (the job's cause when another node failed
        first), or it is a spare node the job ended without (it ran nothing: a success)."""
        cause = None
        if isinstance(exc, SpareNodeUnused):
            logger.info(str(exc))
            self.notes.append(str(exc))
        else:
            logger.error(str(exc) if exc.cause is None else f"the job failed on another node: {exc}")
            cause = exc.cause if exc.cause is not None else RootCause(
                "rendezvous", exc.exit_code, str(exc), node=self.rendezvous.node_rank)
        return AttemptReport(attempt=order.number, started_at=started_at, duration_s=duration_s,
                             exit_code=cause.exit_code if cause else 0, outcome=cause.kind if cause else "success",
                             root_cause=cause, resumed_from=order.resume, log_dir=str(log_dir), teardown_s=None,
                             workers=[], excluded_gpus=list(order.excluded))

    def _warm_spare_node(self, order: AttemptOrder, log_dir: Path, guard: OrphanGuard) -> None:
        """A spare node standing by: one warm spare per local device (supervisor/processes/spare_node_workers.py),
        started once; what it reads before it has a rank is the config and the dataset cache."""
        if self.spare_node_workers is not None or self.mode != "train":
            return
        run_env = RunEnv(run_id=self.run_id, run_dir=str(self.run_dir), master_addr=self.launch.node.master_addr,
                         master_port=0, supervisor_pid=os.getpid(), config_path=str(self.run_dir / "config.json"),
                         dataset_cache=order.dataset_path)
        self.spare_node_workers = SpareNodeWorkers(AttemptLive(self.cfg, self.command, order.plan, run_env,
                                                               python_env(), log_dir, guard.watch))
        started = self.spare_node_workers.start()
        logger.info(f"spare node: {len(started)} warm worker(s) (pid {', '.join(str(s.pid) for s in started)}) import "
                    "torch and the trainer and rehearse the first step while the node stands by")

    def _spare_node_done(self, guard: OrphanGuard) -> None:
        """The spare node's warm workers no rank took are ended (the job ended, or this node was promoted)."""
        if self.spare_node_workers is not None:
            self.spare_node_workers.discard(guard.forget)
            self.spare_node_workers = None

    def _log_dir(self, attempt: int) -> Path:
        """Where an attempt's worker logs go: the run directory (requeue-N/ for start N of a SLURM
        job started again), attempt-N/ below it for a restart; the directory above when its disk
        refuses a new one."""
        base = self.log_base
        if base != self.run_dir:
            try:
                rundir.create(base, exist_ok=True)
            except rundir.RunDirError as exc:
                logger.warning(f"{exc}: this start logs into {self.run_dir}")
                base = self.run_dir
        if attempt == 0:
            return base
        try:
            return rundir.create(base / f"attempt-{attempt}")
        except rundir.RunDirError as exc:
            logger.warning(f"{exc}: attempt {attempt} logs into {base}")
            return base

    def _prepare_attempt(self, order: AttemptOrder, setup: Setup, log_dir: Path, metrics: MetricsSink,
                         guard: OrphanGuard) -> Attempt:
        """Everything an attempt's supervision needs, before the first worker exists."""
        attempt = order.number
        cfg, plan = self.cfg, setup.plan
        multi, node = self.rendezvous.nnodes > 1, self.rendezvous.node_rank
        # Multi-node: every node's first worker is CPU0/GPU0, so lines name the node too (n1/GPU0:),
        # and the built-in trainer's console carries rank 0's training lines plus every rank's
        # warnings and errors unless --log-ranks says otherwise (a --script's ranks print what
        # they like, as under torchrun); every line of every rank is in its log file either way.
        logs = {s.rank: WorkerLog(s.rank, s.tag, log_dir / f"worker-rank{s.rank}-{s.tag}.log",
                                  self.launch.torchrun.line_prefix(s.rank, s.local)
                                  or (f"n{node}/{s.tag}:" if multi else None)) for s in plan.slots}
        log_ranks = [0] if multi and self.mode == "train" and cfg.system.log_ranks is None else cfg.system.log_ranks
        lines = self.relay.attempt(self.rendezvous.lines, setup.world_size,
                                   _node_judge(cfg, self.rendezvous, attempt, metrics) if node == 0 else None) \
            if multi else None  # every node's console lines folded, and its pace judged, on node 0
        router = LogRouter(list(logs.values()), self.console, log_ranks, cfg.system.collapse_logs,
                           nccl_watch=_nccl_watch(plan), relay=lines)
        stragglers = self._stragglers(metrics, multi, len(plan.slots))
        heartbeats = Heartbeats([s.rank for s in plan.slots], time.monotonic(), self.timeouts,
                             cfg.system.rendezvous_timeout, expect_heartbeats=self.mode == "train",
                             stragglers=stragglers, write_metric=metrics.write)
        trace_dir = log_dir / "collective-traces"
        if plan.kind == "cuda":  # NCCL's own dump on a watchdog timeout lands here (worker_env.flight_recorder_env)
            (trace_dir / "nccl-timeout").mkdir(parents=True, exist_ok=True)
        suspects = SuspectWatch(plan, attempt)
        stop = StopRules(cfg.system.grace_period, self.stop_timeout) if self.mode == "train" \
            else StopRules.for_script(cfg.system.grace_period, self.stop_timeout)
        run_env = self._run_env(order, setup, log_dir, trace_dir)
        timer = FileTimer(Path(run_env.timer_file), log_dir / "file-timer.log") if run_env.timer_file else None
        live = live_for_attempt(
            AttemptLive(cfg, self._command_of(0), plan, run_env, python_env() if self.mode == "train" else script_env(),
                        log_dir, guard.watch, tell=self.store_server.set if setup.store is not None else None,
                        lend=self.standbys.lend),
            budget=order.live_budget, attempt=attempt,  # tell: multi-node, node 0
            numbered_from=len(self.recoveries), script=self.launch.script, multi_node=self.launch.node.multi,
            write_metric=metrics.write, regroup=self.rendezvous.regroup(attempt),
            node=self.rendezvous.node_rank if multi else None)
        observers = [self.checkpoints.observe, suspects.observe, self.progress.observe, self._first_step] + (
            [live.observe] if live is not None else []) + ([self.script_saves.observe] if self.mode == "script" else [])
        sup = Supervision([], router, heartbeats, metrics, stop, finish_window=self.timeouts.policy.step_default,
                          on_cause=self._announcer(attempt, guard if _last(order, self.launch.node.multi) else None),
                          on_record=_fan_out(*observers),
                          script=self.mode == "script", unwatched_why=_unwatched_why(self.launch),
                          trace_dir=trace_dir, live=live, requests=self.spare_desk)
        return Attempt(attempt, setup, logs, router, heartbeats, sup, run_env, metrics, stragglers, suspects, timer=timer,
                       live=live)

    def _stragglers(self, metrics: MetricsSink, multi: bool, ranks: int) -> Stragglers:
        """This node's ranks compared every window; multi-node, its pace sent to node 0 too (and
        node 0's judge of every node's ticked with them)."""
        system = self.cfg.system
        return Stragglers(system.straggler_factor, system.straggler_windows, metrics.write,
                          moves=MoveOut(system.straggler_move_factor, system.straggler_move_after_s),
                          pace=self.relay.pace if multi else None, nodes=self.relay.paces if multi else None,
                          solo=multi and ranks == 1)

    def _run_env(self, order: AttemptOrder, setup: Setup, log_dir: Path, trace_dir: Path) -> RunEnv:
        """What every worker of this attempt is told of the run (worker_env turns it into variables)."""
        torchrun = self.launch.torchrun
        return RunEnv(run_id=self.run_id, run_dir=str(self.run_dir), master_addr=setup.master_addr,
                      master_port=setup.master_port, supervisor_pid=os.getpid(),
                      config_path=str(self.run_dir / "config.json"), dataset_cache=order.dataset_path,
                      restart_count=order.restart_count, max_restarts=self.cfg.system.max_restarts,
                      resume=setup.resume or "",
                      world_size=setup.world_size, node_rank=self.rendezvous.group_rank,
                      nnodes=self.rendezvous.nnodes, trace_dir=str(trace_dir), role=torchrun.role,
                      signals_to_handle=torchrun.signals_to_handle,
                      virtual_local_rank=torchrun.virtual_local_rank,
                      timer_file=str(timer_fifo(os.environ, log_dir)) if file_timer_wanted(os.environ) else "")

    def _announcer(self, attempt: int, leaving: OrphanGuard | None) -> Callable[[RootCause], RootCause]:
        """What the supervision calls with this node's root cause the moment it has one (on a
        thread of its own): a stop SLURM sent (scancel, the time limit, a preemption, a requeue) is
        named as that, in words every node reports alike; then the other nodes are told. Returns the
        cause as published (the supervision's policy takes it as the root cause). `leaving`: the
        run ends with this attempt, so the supervisor leaves the run's cgroup now, while its workers
        are torn down (the kernel's wait on that move overlaps their exits instead of following
        them; nothing is started from here on, and what runs stays in the cgroup)."""
        publish = self.rendezvous.publisher(attempt)

        def announce(cause: RootCause) -> RootCause:
            signame, job_id = cause.signal, os.environ.get("SLURM_JOB_ID")
            if cause.kind == "terminated" and signame and job_id:
                job = job_info(job_id) if signame not in ("SIGUSR1", "SIGUSR2") else {}
                logger.debug(f"{signame} under SLURM: job {job_id}: " + " ".join(
                    f"{k}={job.get(k)}" for k in ("JobState", "Reason", "PreemptTime", "Restarts")))
                stop = slurm_stop(signame, job, self.requeue)
                if stop is not None:
                    cause = dataclasses.replace(cause, message=stop.message, slurm_stop=True, preempted=stop.preempted)
            if publish is not None:
                publish(cause)
            if leaving is not None:
                leaving.step_out()
            return cause
        return announce

    def _supervise(self, att: Attempt, guard: OrphanGuard) -> RootCause | None:
        """Spawn, watch until the end, and leave nothing of the attempt running."""
        plan, store, sup = att.setup.plan, att.setup.store, att.sup
        base_env = python_env() if self.mode == "train" else script_env()
        watchers: list[RunWatcher] = []
        cause: RootCause | None = None
        sup.install_signal_handlers()
        self.rendezvous.watch(att.number, on_remote=sup.report_remote)
        if att.live is not None and att.live.regroup is not None:  # the other nodes' live recoveries
            att.live.regroup.follow(sup.report_regroup)
        try:
            if att.timer is not None:  # before any rank: a rank's first timer needs the server's FIFO
                guard.watch(att.timer.start(sys.executable, python_env(), self.run_id, die_with_parent()))
            if store is not None:  # before the ranks: its first start imports torch while they spawn
                store_proc = self.store_server.serve(store)
                if store_proc.pid not in self._guarded:
                    guard.watch(store_proc.pid)
                    self._guarded.add(store_proc.pid)
                sup.watch_helper("rendezvous store", store_proc, self.store_server.failure)
            bindings = numa_plan(self.launch.torchrun.numa_binding, plan, first=att.number == 0)
            for i, slot in enumerate(plan.slots):
                w = self._start_worker(att, slot, bindings[i] if bindings else None, base_env)
                sup.add_worker(w)
                att.workers.append(w)
                guard.watch(w.pgid)
            self._spare_node_done(guard)
            if att.live is not None and att.setup.promotion is not None:
                att.live.promoted(att.setup.join_generation, att.setup.promotion, att.workers, time.monotonic())
            if att.live is not None and not att.live.lazy_spares:  # else once a rank attaches (gpuherd.live)
                att.live.pool.fill()  # after the workers: a spare never delays the training start
            self._standbys_due = lambda: self._start_standbys(att, base_env, guard, numa=bool(bindings))
            logger.debug(f"attempt {att.number}: spawned {len(att.workers)} worker(s); rendezvous store on "
                         f"{att.setup.master_addr}:{att.setup.master_port}")
            watchers = _start_watchers(self.cfg, plan, self.run_dir, sup, att, att.workers)
            cause = sup.run()
        except OSError as exc:
            cause = RootCause("supervisor", ExitCode.FAILURE, f"cannot start worker: {exc}")
            logger.error(cause.message)
        finally:
            self._end_attempt(att, guard, watchers)
        return cause

    def _start_worker(self, att: Attempt, slot: DeviceSlot, binding: Binding | None,
                      base_env: dict[str, str]) -> WorkerProcess:
        """One rank's worker: a standby (unbound ranks only) or a promoted spare node's warm
        worker where one waits, else a new process; bound to its NUMA CPUs where asked."""
        env_of = _env_of(att, slot, base_env)
        w = self.standbys.take(slot, env_of(-1), att.logs[slot.rank].path) if binding is None else None
        if w is None and self.spare_node_workers is not None:  # a spare node promoted: its warm workers
            w = self.spare_node_workers.take(slot, env_of(-1), att.logs[slot.rank].path)
        if w is None:
            w = spawn(bound(binding, self._command_of(slot.local)), env_of, slot, att.logs[slot.rank].path)
        if binding is not None and not shutil.which("numactl"):
            with contextlib.suppress(ProcessLookupError):  # already gone: its exit tells the rest
                os.sched_setaffinity(w.pid, binding.cpus)  # before it starts a thread: they inherit it
        return w

    def _first_step(self, record: Record) -> None:
        """The attempt's first completed step: its start, which the standbys' imports would slow
        (each is a session of its own: the kernel's autogroups share the CPU by session, whatever a
        thread's nice value), is over."""
        if isinstance(record, Step) and self._standbys_due is not None:
            start, self._standbys_due = self._standbys_due, None
            start()

    def _start_standbys(self, att: Attempt, base_env: dict[str, str], guard: OrphanGuard, numa: bool) -> None:
        """At the attempt's first step: a restart standby per local rank for the next attempt, where
        a script (through the bootstrap) may still be restarted (supervisor/processes/standbys.py)."""
        script, run_env, plan = self.launch.script, att.run_env, att.setup.plan
        if script is None or not script.bootstrapped or not self.cfg.system.standbys or numa \
                or run_env.restart_count >= run_env.max_restarts:
            return

        def start(slot):
            error_file = str(error_file_for(att.logs[slot.rank].path))
            env = standby_env(worker_env(base_env, plan, slot, run_env, -1, error_file=error_file))
            process = spawn(self._command_of(slot.local), lambda fd: {**env, contract.STATUS_FD: str(fd)}, slot,
                            att.logs[slot.rank].path, stdin_pipe=True)
            return process, env

        try:
            started = self.standbys.fill(list(plan.slots), start)
        except OSError as exc:  # no standby: the next restart starts fresh interpreters, as without them
            logger.warning(f"restart standbys not started ({exc}); a restart starts fresh interpreters")
            return
        for standby in started:
            guard.watch(standby.pgid)
        logger.debug(f"attempt {att.number}: restart standbys {sorted(self.standbys.pids())}")

    def retire_standbys(self, guard: OrphanGuard | None) -> None:
        """The job's end: the standbys no attempt needs are ended and reaped."""
        for pgid in self.standbys.retire():
            if guard is not None:
                guard.forget(pgid)

    def _command_of(self, local_rank: int) -> list[str]:
        """A script's command line with `${local_rank}` filled in (torchrun's macros); the built-in
        worker's is the same for every rank."""
        return self.launch.script.command(local_rank) if self.launch.script else self.command

    def _end_attempt(self, att: Attempt, guard: OrphanGuard, watchers: list[RunWatcher]) -> None:
        store, sup = att.setup.store, att.sup
        self._standbys_due = None
        self.rendezvous.unwatch()
        if att.live is not None and att.live.regroup is not None:
            att.live.regroup.stop()
        sup.force_kill_everything()
        if att.timer is not None and att.timer.proc is not None:
            guard.forget(att.timer.proc.pid)
            att.timer.stop()
        for watcher in watchers:
            _stop_watcher(watcher)
        att.router.close()
        if store is not None:
            store.stop()
            self.store_server.drop()  # the helper stays warm for the next attempt
        if att.live is not None:
            discard_spares(att.live.pool, guard.forget)
        sweep_children(exclude={guard.pid, self.rendezvous.helper_pid, self.store_server.pid, *self.standbys.pids()})
        for pgid in {w.pgid for w in [*att.workers, *sup.workers.values()]}:
            guard.forget(pgid)
        sup.restore_signal_handlers()


def _last(order: AttemptOrder, multi_node: bool) -> bool:
    """No restart can follow this attempt, whatever ends it: one node (no membership change), and
    --max-restarts used up before it started (restarts and live recoveries alike; the default 0:
    always)."""
    return not multi_node and order.live_budget <= 0


def _fan_out(*observers: Callable[[dict], None]) -> Callable[[dict], None]:
    """One status-record callback for the supervision loop that hands each record to every observer."""
    def observe(record: dict) -> None:
        for fn in observers:
            fn(record)
    return observe


def _nccl_watch(plan: DevicePlan) -> NcclTransportWatch | None:
    """Only when the user asked NCCL to say which transports it chose (NCCL_DEBUG=INFO):
    two GPUs of this node talking through host memory or the network get a warning."""
    if plan.kind != "cuda" or len(plan.slots) < 2 or os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return None
    return NcclTransportWatch({s.rank for s in plan.slots})


def _unwatched_why(launch: Launch) -> str | None:
    """Why a script's rank that never sent a heartbeat is not judged by heartbeat (said once)."""
    if launch.script is None:
        return None
    if launch.script.bootstrapped:
        return ("no torch optimizer step seen (gpuherd counts them as heartbeats): not watched for hangs "
                "until it steps one")
    return ("no status record from the script (--no-auto-heartbeat or --no-python): not watched for hangs; "
            "send records with gpuherd.status_channel for that")


def _timer_cause(cause: RootCause | None, att: Attempt) -> RootCause | None:
    """A rank killed by the file timer server: the message says which timer expired."""
    if cause is None or att.timer is None or cause.rank is None:
        return cause
    worker = next((w for w in att.workers if w.slot.rank == cause.rank), None)
    scope = att.timer.expired(worker.pid) if worker is not None else None
    if scope is None:
        return cause
    return dataclasses.replace(cause, message=f"{cause.message}: its torch.distributed.elastic.timer "
                                              f"{scope!r} expired (TORCHELASTIC_ENABLE_FILE_TIMER=1)")


def _save_cut(cause: RootCause, unfinished: tuple[str, ...], newest: Path | None) -> RootCause:
    """A stop whose final checkpoint was not written is no normal 130/143: the work since the
    last complete checkpoint is lost, and the user must know before relying on it, and which
    checkpoint a resume would take."""
    fallback = f"the newest complete checkpoint of this run is {newest}" if newest is not None \
        else "this run wrote no complete checkpoint"
    return dataclasses.replace(cause, exit_code=int(ExitCode.FAILURE),
                               message=f"{cause.message}; the final checkpoint was NOT saved: {'; '.join(unfinished)}; "
                                       f"{fallback}")


def _node_judge(cfg: Config, rendezvous: Rendezvous, attempt: int, metrics: MetricsSink) -> NodeStragglers:
    """Node 0's judge of every node's pace, moving a straggler node out through its agent where the job
    has spare nodes (none: named only, as a move could take nothing's place)."""
    system = cfg.system
    judge = NodeStragglers(system.straggler_factor, system.straggler_windows, metrics.write,
                           move_factor=system.straggler_move_factor, move_after_s=system.straggler_move_after_s)
    judge.move = rendezvous.mover(attempt, judge.answered) if system.spare_nodes > 0 else None
    return judge


def _final_save(cause: RootCause | None, sup: Supervision, checkpoints: RunCheckpoints, mode: str,
                checkpoint_dir: Path) -> tuple[RootCause | None, str | None]:
    """How the final save of a stopped attempt went ("saved", "not saved", None: none was
    due), and the outcome that says so: a cut save names what was left unfinished, a
    finished one names the checkpoint."""
    final_save = sup.final_save()
    if final_save == "not saved" and cause is not None:
        cause = _save_cut(cause, sup.state.graceful.unfinished, checkpoints.newest_of_this_run())
        if mode == "train":  # every worker is gone: the cut save's temp file has no writer left
            remove_orphans(checkpoint_dir)
    elif final_save == "saved" and checkpoints.newest_of_this_run() is not None and cause is not None:
        newest = checkpoints.newest_of_this_run()
        # in the outcome itself: every node names the same checkpoint (rank 0 wrote it; each rank reported it)
        cause = dataclasses.replace(cause, message=f"{cause.message}; checkpoint step "
                                                   f"{checkpoints.step_of(newest)} saved: {newest}")
    return cause, final_save


def _env_of(att: Attempt, slot: DeviceSlot, base_env: dict[str, str]) -> Callable[[int], dict[str, str]]:
    """A rank's environment given the fd of its status pipe; its error file is cleared now, so
    only what this attempt's rank writes may be read back."""
    plan = att.setup.plan
    error_file = error_file_for(att.logs[slot.rank].path)
    error_file.unlink(missing_ok=True)
    extra = att.live.worker_env if att.live is not None and not att.live.off else {}
    if att.setup.join_generation:  # a spare node taking a dead node's place: its ranks join the group
        extra = {**extra, contract.JOIN_GENERATION: str(att.setup.join_generation)}

    def env_of(fd: int, slot=slot, ef=str(error_file), extra=extra) -> dict[str, str]:
        return {**worker_env(base_env, plan, slot, att.run_env, fd, error_file=ef), **extra}

    return env_of


def _start_watchers(cfg: Config, plan: DevicePlan, run_dir: Path, sup: Supervision, att: Attempt,
                    workers: list[WorkerProcess]) -> list[RunWatcher]:
    def write_metric(record: dict[str, Any]) -> None:  # the straggler check reads the GPU/host samples too
        att.stragglers.sample(record)
        att.metrics.write(record)

    ctx = RunContext(config=cfg, plan=plan, run_dir=run_dir, pids={w.slot.rank: w.pid for w in workers},
                     write_metric=write_metric, report_fatal=sup.report_fatal)
    started = []
    for factory in (gpu_watcher,):
        watcher = factory(ctx)
        if watcher is not None:
            watcher.start(ctx)
            started.append(watcher)
    return started


def _stop_watcher(watcher: RunWatcher) -> None:
    try:
        watcher.stop()
    except Exception as exc:  # a broken watcher must not keep workers alive or hide the run's outcome
        logger.warning(f"watcher {getattr(watcher, 'name', watcher)} failed to stop: {exc}")


def _report(w: WorkerProcess, cause: RootCause | None, heartbeats: Heartbeats | None, script: bool) -> WorkerReport:
    st = heartbeats.ranks[w.slot.rank] if heartbeats is not None else None
    code = None if w.returncode is None else shell_code(w.returncode)
    if cause is None:
        role = "ok"
    elif cause.rank == w.slot.rank:
        role = "first-failure"
    elif cause.kind == "interrupted":
        role = "interrupted"
    elif cause.kind == "terminated" and SAVE_AND_STOP.name in w.signalled and code == ExitCode.SIGTERM:
        role = "stopped"  # asked to save and stop, and did
    elif w.signalled and any(s in ("SIGTERM", "SIGKILL", TEARDOWN_NAME) for s in w.signalled):
        role = "victim"
    else:
        role = "ok" if code == 0 else "failed"
    return WorkerReport(
        rank=w.slot.rank, device=w.slot.tag, pid=w.pid, exit_code=code, ended=how_it_ended(w.returncode, script),
        role=role,
        signals_sent=list(w.signalled), last_step=st.step if st else None, phase=st.phase if st else None,
        status_records=st.records if st else 0,
        seconds=None if w.ended is None else round(w.ended - w.started, 3), log=str(w.log_path),
    )
