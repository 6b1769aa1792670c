"""One training job: its attempts, from spawning the workers to the summary.

An attempt: rendezvous (exit 5 when a node never joins) -> spawn one worker per
device -> supervise until the end -> the job's root cause. `--max-restarts N`: a
failure worth retrying starts the next attempt, resuming from the newest checkpoint
this run wrote, on a dataset cache checked (and rebuilt if it went missing or was
damaged) again first. The end: summary.json and the root-cause block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
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
from gpuherd.log_writes import LOG_WRITES
from supervisor import goodput
from supervisor import requeue as requeues
from supervisor import run_dir as rundir
from supervisor.cli import Launch
from supervisor.goodput import marks
from supervisor.gpus import DeviceError, DevicePlan
from supervisor.health import (
    HangPolicy,
    Heartbeats,
    LearnedTimeouts,
    MetricsSink,
    NcclTransportWatch,
    RunContext,
    RunWatcher,
    Stragglers,
    SuspectWatch,
    gpu_watcher,
    hang_timeouts,
    previous_learned,
)
from supervisor.output import STDERR, Console, LogRouter, WorkerLog
from supervisor.processes import (
    SAVE_AND_STOP,
    AttemptLive,
    LiveRecovery,
    OrphanGuard,
    RunEnv,
    StopRules,
    StopSignal,
    Supervision,
    WorkerProcess,
    become_subreaper,
    die_with_parent,
    discard_spares,
    error_file_for,
    helper_preexec,
    live_for_attempt,
    python_env,
    script_env,
    spawn,
    stop_exit_code,
    stops_raise,
    sweep_children,
    worker_env,
)
from supervisor.rendezvous import (
    PREEMPTION,
    NodeLinkError,
    Rendezvous,
    Setup,
    SingleNode,
    StoreServer,
    job_info,
    requeue_after_preemption,
    stop_reason,
    training_fingerprint,
)
from supervisor.restarts import Progress, RestartPlan, RunCheckpoints, SuspectExclusion, pause, plan_restart
from supervisor.summary import AttemptReport, RootCause, Summary, WorkerReport, how_it_ended, now_iso, shell_code
from supervisor.torchrun import (
    FileTimer,
    bound,
    file_timer_wanted,
    numa_plan,
    timer_fifo,
    write_launcher_error_file,
)

TEARDOWN_NAME = signal.Signals(contract.TEARDOWN_SIGNAL).name


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


class Job:
    def __init__(self, launch: Launch, plan: DevicePlan, run_id: str, run_dir: Path, command: list[str],
                 started_at: str, t0: float, console: Console, stop_timeout: float) -> None:
        """`console`: the one writer of everything the supervisor prints (main.py);
        `stop_timeout`: system.stop_timeout, shortened under SLURM to fit its KillWait."""
        self.launch, self.plan, self.run_id, self.run_dir = launch, plan, run_id, run_dir
        self.cfg = launch.config
        self.command, self.started_at, self.t0 = command, started_at, t0
        self.console, self.stop_timeout = console, stop_timeout
        self.dataset_path = ""
        self.notes: list[str] = []
        self.rendezvous: Rendezvous = SingleNode()
        self.checkpoints = RunCheckpoints()
        self.progress = Progress()  # the attempt under way's
        self.stragglers: list[dict] = []  # every attempt's straggler warnings
        self.timeouts = self._learned_timeouts()
        self.store_server = StoreServer(sys.executable, python_env(), helper_preexec())  # warm across attempts
        self._guarded: set[int] = set()  # helper processes the orphan guard already knows
        self.exclusion = SuspectExclusion(self.cfg.system.exclude_suspect_gpus, multi_node=launch.node.multi)
        self.recoveries: list[dict] = []  # every live recovery of every attempt (summary.json)
        self.requeue = launch.requeue  # SLURM requeued the job this many times (SLURM_RESTART_COUNT)
        self.slurm_job_id = launch.slurm_job_id
        self.start = launch.start  # >= 1: a SLURM job started again (requeued or resubmitted): its run goes on here
        self.log_base = requeues.log_dir(run_dir, self.start)
        self.earlier_starts = requeues.earlier_starts(run_dir, self.start) if self.start else []
        self.guard: OrphanGuard | None = None  # started before the dataset build (start_guard)
        self._released_guard: OrphanGuard | None = None  # told to exit; reaped just before ours (reap_helpers)
        self.restarts_used = 0  # failures restarted (--max-restarts); an elastic membership change is not one
        self.dataset_s: float | None = None  # the first dataset build's seconds (goodput: `dataset`)
        self.goodput: goodput.Goodput | None = None  # the whole run's, every start's (summary.json)
        self.goodput_charts = goodput.GoodputScalars(run_dir)  # imports tensorboard's writer in the background

    @property
    def mode(self) -> str:
        return "script" if self.launch.script else "train"

    def _learned_timeouts(self) -> LearnedTimeouts:
        """One learner for the whole job: a restart starts from what earlier attempts learned,
        a --resume from what the newest run with the same settings left in its run directory."""
        system = self.cfg.system
        hang, startup = hang_timeouts(self.cfg.preset, system.hang_timeout, system.startup_timeout,
                                      script=self.mode == "script")
        policy = HangPolicy(step_default=hang, startup=startup, factor=system.hang_factor, floor=system.hang_floor,
                            override=system.hang_timeout)
        fingerprint = f"{training_fingerprint(self.cfg)}-{self.mode}-{self.plan.world_size}"
        initial = None
        if self.cfg.training.resume is not None and system.hang_timeout <= 0:
            initial = previous_learned(Path(system.run_root), fingerprint, exclude=self.run_dir)
            if initial:
                logger.info("hang allowances learned by an earlier run with these settings: " + ", ".join(
                    f"{phase} {seconds:.0f} s" for phase, seconds in initial.items()))
        return LearnedTimeouts(policy, initial, fingerprint)

    def prepare_dataset(self) -> RootCause | None:
        """Built once, here, before any worker exists; workers only read it."""
        return self.recheck_dataset()[0]

    def recheck_dataset(self) -> tuple[RootCause | None, bool]:
        """(failure, rebuilt): prepare_cache reuses a sound cache and, under its lock, rebuilds
        one that is missing or damaged (sizes always checked, checksums with data.verify_cache)."""
        try:
            from dataset_cache import DatasetError, prepare_cache
        except ImportError as exc:
            return RootCause("dataset", ExitCode.DATA, f"the dataset_cache package is unusable: {exc}"), False
        try:
            with stops_raise():  # a stop signal during the build ends the run with a summary, the pool cleaned up
                info = prepare_cache(self.cfg.data)
        except StopSignal as stop:
            return _stop_cause(stop.signum, "while preparing the dataset"), False
        except DatasetError as exc:
            logger.error(f"dataset: {exc}")
            return RootCause("dataset", ExitCode.DATA, f"dataset: {exc}"), False
        except KeyboardInterrupt:
            return RootCause("interrupted", ExitCode.SIGINT, "interrupted by Ctrl-C while preparing the dataset"), False
        except Exception as exc:  # noqa: BLE001 - a defect in the build still ends with a named cause and a summary
            logger.opt(exception=exc).bind(file_only=True).error("dataset: the build failed unexpectedly")
            message = f"dataset: the cache could not be built: {type(exc).__name__}: {exc}"
            logger.error(message)
            return RootCause("dataset", ExitCode.DATA, message), False
        rebuilt = info.built and bool(self.dataset_path)
        if not self.dataset_path:
            self.dataset_s = info.seconds
        self.dataset_path = str(info.path)
        logger.info(f"dataset cache {'rebuilt' if rebuilt else 'built' if info.built else 'reused'}: {info.path} "
                    f"({info.train_tokens:,} train / {info.val_tokens:,} val tokens, {info.seconds:.1f} s)")
        return None, rebuilt

    def run(self) -> int:
        """Every attempt until one succeeds, a failure is not worth restarting, or
        `system.max_restarts` restarts are used up."""
        system = self.cfg.system
        guard = self.start_guard()
        metrics = MetricsSink(self.run_dir / "metrics.jsonl")
        metrics.write(marks.start(self.start, self.t0, self.dataset_s))
        attempts: list[AttemptReport] = []
        final: RootCause | None = None
        resume = self._requeue_resume(metrics)
        streak = 0  # quick failures in a row: each doubles the pause
        try:
            attempt = 0
            while True:
                report = self.run_attempt(attempt, resume, guard, metrics)
                attempts.append(report)
                report.root_cause = self._blame_the_cache(report.root_cause)
                final = report.root_cause
                if final is None:
                    break
                used = self.restarts_used + self._recovered()  # --max-restarts counts recoveries and restarts alike
                plan = plan_restart(final, stop_signal=report.stop_signal, attempt=used,
                                    max_restarts=system.max_restarts, train=self.mode == "train",
                                    restart_on_nan=system.restart_on_nan, base_backoff=system.restart_backoff,
                                    streak=streak, ran_s=report.duration_s, progressed=self.progress.made)
                membership = not plan.counted  # elastic: a node joins
                why_not = plan.why_not if membership else (
                    self._after_dataset_check(plan) or self._exclude_suspects(final, report, attempt + 1))
                if why_not:
                    if system.max_restarts:  # say why only where a restart was on the table
                        report.not_restarted = why_not
                    break
                newest = self.checkpoints.newest_of_this_run()
                resume = str(newest) if newest is not None else None
                delay = plan.delay
                if plan.counted:
                    streak = plan.streak
                    self.restarts_used += 1
                logger.warning(f"attempt {attempt} " + ("ended" if membership else "failed") + f" ({final.message}); "
                               + ("restarting" if membership else f"restart {used + 1} of {system.max_restarts}")
                               + f" in {delay:g} s, "
                               + (f"resuming from {resume}" if resume else "starting as the first attempt did "
                                  "(no checkpoint written yet)"))
                metrics.write({"type": "restart", "time": time.time(), "attempt": attempt + 1,
                               "after": final.message, "exit_code": final.exit_code, "resume": resume,
                               "membership": membership, "restarts_used": self.restarts_used,
                               "excluded_gpus": list(self.exclusion.excluded), "world_size": self.plan.world_size})
                self._goodput_so_far()
                signum = pause(delay)
                if signum is not None:
                    final = _stop_cause(signum, f"during the pause before attempt {attempt + 1}")
                    break
                attempt += 1
        except KeyboardInterrupt:  # Ctrl-C in the instant between an attempt's handlers and the pause
            final = _stop_cause(signal.SIGINT, "between attempts")
        finally:
            self.goodput = self._goodput_so_far(end_of_start=metrics)
            metrics.close()
            self.release_guard(dying=self.store_server.close(wait=False))
        return self.finish(final, attempts)

    def _goodput_so_far(self, end_of_start: MetricsSink | None = None) -> goodput.Goodput:
        """The whole run's goodput now (every start's), also a point in TensorBoard; at the end of
        a start, also its `goodput` record in metrics.jsonl."""
        events = goodput.read_events(self.run_dir / "metrics.jsonl")
        now = time.time()
        account = goodput.account(events, now)
        self.goodput_charts.write(account, goodput.last_step(events), now)
        if end_of_start is not None:
            end_of_start.write({"type": "goodput", "time": now, **account.to_dict()})
            self.goodput_charts.close()
        return account

    def _blame_the_cache(self, cause: RootCause | None) -> RootCause | None:
        """A built-in worker killed by SIGBUS touched a page of its memory-mapped dataset cache that
        is no longer in the file: the cache was truncated under the run. Its size check names it,
        and the cause becomes a data error (exit 3; with restarts, the cache is rebuilt first)."""
        if cause is None or self.mode != "train" or not self.dataset_path or cause.kind != "worker-exit" \
                or cause.exit_code != 128 + signal.SIGBUS:
            return cause
        from dataset_cache import DatasetError, open_data

        try:
            open_data(Path(self.dataset_path))
        except DatasetError as exc:
            who = f"{cause.device} (rank {cause.rank})" if cause.device else f"rank {cause.rank}"
            message = f"{exc}: {who} was killed by SIGBUS reading it (the cache changed while the run read it)"
            logger.error(message)
            return dataclasses.replace(cause, kind="dataset", exit_code=int(ExitCode.DATA), message=message)
        return cause

    def _recovered(self) -> int:
        return sum(1 for r in self.recoveries if r["outcome"] == "recovered")

    def _requeue_resume(self, metrics: MetricsSink) -> str | None:
        """The first attempt of a SLURM job started again (requeued, or its script submitted
        again) resumes from the newest checkpoint its run saved so far."""
        if not self.start:
            return None
        newest = requeues.replay_checkpoints(self.run_dir, self.checkpoints)
        resume = str(newest) if newest is not None else None
        how = (f"SLURM requeued this job (SLURM_RESTART_COUNT={self.requeue})" if self.requeue
               else f"job {self.slurm_job_id} was submitted again with --run-id {self.run_id}")
        logger.warning(f"{how}: run {self.run_id} goes on (start {self.start}) in {self.run_dir}, this start's "
                       f"logs in {self.log_base.name}/, "
                       + (f"resuming from {resume}" if resume else "no checkpoint of this run to resume from"))
        metrics.write({"type": "requeue", "time": time.time(), "start": self.start, "restart_count": self.requeue,
                       "slurm_job_id": self.slurm_job_id, "resume": resume, "log_dir": str(self.log_base)})
        return resume
    def start_guard(self) -> OrphanGuard:
        """From here to the end nothing the supervisor starts can outlive it: every process
        (the dataset build's tokenizer pool and its forkserver, helpers, workers and what they
        fork) carries the guard's marker in its environment, is reparented to us if it escapes
        its parent, and is killed by the guard if the supervisor dies, even by SIGKILL."""
        if self.guard is None:
            become_subreaper()
            os.environ[contract.SUPERVISOR_PID] = str(os.getpid())  # inherited by every process started from now
            self.guard = OrphanGuard(f"{contract.SUPERVISOR_PID}={os.getpid()}", sys.executable, python_env())
        return self.guard

    def release_guard(self, dying: int | None = None) -> None:
        """Whatever is still below us is killed; then the guard exits without touching anything.
        `dying`: a helper already SIGKILLed, not to be waited for."""
        if self.guard is not None:
            sweep_children(exclude={self.guard.pid, self.rendezvous.helper_pid, dying})
            self.guard.release()
            self._released_guard, self.guard = self.guard, None

    def reap_helpers(self) -> None:
        """Last, just before the exit code: the store helper and the guard, ended earlier (their
        exits overlapped the summary), are reaped: none of the launcher's processes outlives it."""
        self.store_server.reap()
        if self._released_guard is not None:
            self._released_guard.reap()
            self._released_guard = None

    def _after_dataset_check(self, plan: RestartPlan) -> str | None:
        """The restart policy's answer, once the dataset cache it asked to check was checked
        (and rebuilt if it went missing or was damaged). None: restart."""
        if not plan.check_dataset:
            return plan.why_not
        failure, rebuilt = self.recheck_dataset()
        if failure is not None:
            return f"the dataset cache cannot be rebuilt: {failure.message}"
        return None if rebuilt else plan.why_not

    def _exclude_suspects(self, cause: RootCause, report: AttemptReport, next_attempt: int) -> str | None:
        """None: restart, without the suspect GPUs under --exclude-suspect-gpus; else why not
        (none would be left: the run ends with the attempt's exit 8)."""
        try:
            self.plan = self.exclusion.next_plan(self.plan, cause, report.suspect_devices, next_attempt)
        except DeviceError as exc:
            return str(exc)
        return None

    def run_attempt(self, attempt: int, resume: str | None, guard: OrphanGuard, metrics: MetricsSink) -> AttemptReport:
        """Start every worker once, supervise them to the end, clean up everything but the job's files."""
        started_at, t0 = now_iso(), time.monotonic()
        log_dir = self._log_dir(attempt)
        metrics.write(marks.attempt(attempt, resumed=resume is not None))
        self.progress = Progress()
        try:
            setup = self.rendezvous.begin(attempt, self.plan, resume)
        except NodeLinkError as exc:
            logger.error(str(exc) if exc.cause is None else f"the job failed on another node: {exc}")
            cause = RootCause.from_dict(exc.cause) if exc.cause is not None else RootCause(
                "rendezvous", exc.exit_code, str(exc), node=self.rendezvous.node_rank)
            return AttemptReport(attempt=attempt, started_at=started_at, duration_s=round(time.monotonic() - t0, 3),
                                 exit_code=cause.exit_code, outcome=cause.kind, root_cause=cause, resumed_from=resume,
                                 log_dir=str(log_dir), teardown_s=None, workers=[],
                                 excluded_gpus=list(self.exclusion.excluded))
        att = self._prepare_attempt(attempt, setup, log_dir, metrics, guard)
        cause = _timer_cause(self._supervise(att, guard), att)
        cause = self.rendezvous.settle(attempt, cause, att.sup.notes)
        metrics.write(marks.attempt_end(attempt, cause.kind if cause else None, att.sup.state.failed_at))
        self.stragglers += [{**found, "attempt": attempt} for found in att.stragglers.found]
        try:
            self.timeouts.save(self.run_dir)
        except OSError as exc:  # a full log disk: the allowances were learned all the same
            logger.warning(f"hang allowances not saved to {self.run_dir} ({exc.strerror}); the next --resume "
                           "learns them again")
        sup = att.sup
        final_save = sup.final_save()
        if final_save == "not saved" and cause is not None:
            cause = _save_cut(cause, sup.state.graceful.unfinished, self.checkpoints.newest_of_this_run())
            if self.mode == "train":  # every worker is gone: the cut save's temp file has no writer left
                remove_orphans(Path(self.cfg.system.checkpoint_dir))
        elif final_save == "saved" and self.checkpoints.newest_of_this_run() is not None and cause is not None:
            newest = self.checkpoints.newest_of_this_run()
            # in the outcome itself: every node names the same checkpoint (rank 0 wrote it; each rank reported it)
            cause = dataclasses.replace(cause, message=f"{cause.message}; checkpoint step "
                                                       f"{self.checkpoints.step_of(newest)} saved: {newest}")
        self.notes += sup.notes
        recoveries = att.live.settle() if att.live is not None else []
        self.recoveries += recoveries
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
            final_save=final_save,
            suspect_devices=att.suspects.devices(self.exclusion.enabled), excluded_gpus=list(self.exclusion.excluded))

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

    def _prepare_attempt(self, attempt: int, setup: Setup, log_dir: Path, metrics: MetricsSink,
                         guard: OrphanGuard) -> Attempt:
        """Everything an attempt's supervision needs, before the first worker exists."""
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
        router = LogRouter(list(logs.values()), self.console, log_ranks, cfg.system.collapse_logs,
                           nccl_watch=_nccl_watch(plan))
        stragglers = Stragglers(cfg.system.straggler_factor, cfg.system.straggler_windows, metrics.write)
        heartbeats = Heartbeats([s.rank for s in plan.slots], time.monotonic(), self.timeouts,
                             cfg.system.rendezvous_timeout, expect_heartbeats=self.mode == "train",
                             stragglers=stragglers, write_metric=metrics.write)
        trace_dir = log_dir / "collective-traces"
        if plan.kind == "cuda":  # NCCL's own dump on a watchdog timeout lands here (worker_env.flight_recorder_env)
            (trace_dir / "nccl-timeout").mkdir(parents=True, exist_ok=True)
        suspects = SuspectWatch(plan, attempt)
        stop = StopRules(cfg.system.grace_period, self.stop_timeout) if self.mode == "train" \
            else StopRules.for_script(cfg.system.grace_period, self.stop_timeout)
        run_env = RunEnv(run_id=self.run_id, run_dir=str(self.run_dir), master_addr=setup.master_addr,
                         master_port=setup.master_port, supervisor_pid=os.getpid(),
                         config_path=str(self.run_dir / "config.json"), dataset_cache=self.dataset_path,
                         restart_count=self.restarts_used, max_restarts=cfg.system.max_restarts,
                         resume=setup.resume or "",
                         world_size=setup.world_size, node_rank=self.rendezvous.group_rank,
                         nnodes=self.rendezvous.nnodes, trace_dir=str(trace_dir), role=self.launch.torchrun.role,
                         signals_to_handle=self.launch.torchrun.signals_to_handle,
                         virtual_local_rank=self.launch.torchrun.virtual_local_rank,
                         timer_file=str(timer_fifo(os.environ, log_dir)) if file_timer_wanted(os.environ) else "")
        timer = FileTimer(Path(run_env.timer_file), log_dir / "file-timer.log") if run_env.timer_file else None
        live = live_for_attempt(
            AttemptLive(cfg, self.command, plan, run_env, python_env(), log_dir, guard.watch,
                        tell=self.store_server.set if setup.store is not None and not multi else None),
            budget=cfg.system.max_restarts - self.restarts_used - self._recovered(), attempt=attempt,
            numbered_from=len(self.recoveries), script=self.mode == "script", multi_node=self.launch.node.multi,
            write_metric=metrics.write, regroup=self.rendezvous.regroup(attempt),
            node=self.rendezvous.node_rank if multi else None)
        observers = [self.checkpoints.observe, suspects.observe, self.progress.observe] + (
            [live.observe] if live is not None else [])
        sup = Supervision([], router, heartbeats, metrics, stop, finish_window=self.timeouts.policy.step_default,
                          on_cause=self._announcer(attempt), on_record=_fan_out(*observers),
                          script=self.mode == "script", unwatched_why=_unwatched_why(self.launch),
                          trace_dir=trace_dir, live=live)
        return Attempt(attempt, setup, logs, router, heartbeats, sup, run_env, metrics, stragglers, suspects, timer=timer,
                       live=live)

    def _announcer(self, attempt: int) -> Callable[[RootCause], RootCause]:
        """What the supervision calls with this node's root cause the moment it has one: a stop
        SLURM sent (scancel, the time limit, a preemption, a requeue) is named as that, in words
        every node reports alike; then the other nodes are told. Returns the cause as published
        (the supervision's policy takes it as the root cause)."""
        publish = self.rendezvous.publisher(attempt)

        def announce(cause: RootCause) -> RootCause:
            signame = cause.message.rsplit(" ", 1)[-1]  # the supervision says "... received SIGTERM"
            job_id = os.environ.get("SLURM_JOB_ID")
            if cause.kind == "terminated" and signame.startswith("SIG") and job_id:
                job = job_info(job_id) if signame not in ("SIGUSR1", "SIGUSR2") else {}
                logger.debug(f"{signame} under SLURM: job {job_id}: " + " ".join(
                    f"{k}={job.get(k)}" for k in ("JobState", "Reason", "PreemptTime", "Restarts")))
                cause = dataclasses.replace(cause, message=stop_reason(signame, job, self.requeue) or cause.message)
            if publish is not None:
                publish(cause)
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
            bindings = numa_plan(self.launch.torchrun.numa_binding, plan, first=att.number == 0)
            for i, slot in enumerate(plan.slots):
                error_file = error_file_for(att.logs[slot.rank].path)
                error_file.unlink(missing_ok=True)  # only what this attempt's rank writes may be read back
                binding = bindings[i] if bindings else None
                extra = att.live.worker_env if att.live is not None and not att.live.off else {}
                w = spawn(bound(binding, self._command_of(slot.local)), lambda fd, slot=slot, ef=str(error_file),
                          extra=extra: {**worker_env(base_env, plan, slot, att.run_env, fd, error_file=ef), **extra},
                          slot, att.logs[slot.rank].path)
                if binding is not None and not shutil.which("numactl"):
                    with contextlib.suppress(ProcessLookupError):  # already gone: its exit tells the rest
                        os.sched_setaffinity(w.pid, binding.cpus)  # before it starts a thread: they inherit it
                sup.add_worker(w)
                att.workers.append(w)
                guard.watch(w.pgid)
            if att.live is not None:
                att.live.pool.fill()  # after the workers: a spare never delays the training start
            logger.debug(f"attempt {att.number}: spawned {len(att.workers)} worker(s); rendezvous store on "
                         f"{att.setup.master_addr}:{att.setup.master_port}")
            if store is not None:
                store_proc = self.store_server.serve(store)
                if store_proc.pid not in self._guarded:
                    guard.watch(store_proc.pid)
                    self._guarded.add(store_proc.pid)
                sup.watch_helper("rendezvous store", store_proc, self.store_server.failure)
            watchers = _start_watchers(self.cfg, plan, self.run_dir, sup, att, att.workers)
            cause = sup.run()
        except OSError as exc:
            cause = RootCause("supervisor", ExitCode.FAILURE, f"cannot start worker: {exc}")
            logger.error(cause.message)
        finally:
            self._end_attempt(att, guard, watchers)
        return cause

    def _command_of(self, local_rank: int) -> list[str]:
        """A script's command line with `${local_rank}` filled in (torchrun's macros); the built-in
        worker's is the same for every rank."""
        return self.launch.script.command(local_rank) if self.launch.script else self.command

    def _end_attempt(self, att: Attempt, guard: OrphanGuard, watchers: list[RunWatcher]) -> None:
        store, sup = att.setup.store, att.sup
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
        sweep_children(exclude={guard.pid, self.rendezvous.helper_pid, self.store_server.pid})
        for pgid in {w.pgid for w in [*att.workers, *sup.workers.values()]}:
            guard.forget(pgid)
        sup.restore_signal_handlers()

    def finish(self, cause: RootCause | None, attempts: list[AttemptReport]) -> int:
        exit_code = int(cause.exit_code) if cause is not None else 0
        last = attempts[-1] if attempts else None
        if LOG_WRITES.note():
            self.notes.append(LOG_WRITES.note())
        if self.console.left_out:
            self.notes.append(f"the console fell behind: {self.console.left_out} line(s) were not shown there "
                              "(a terminal that stopped reading); every line is in the log files")
        summary = Summary(
            run_id=self.run_id, run_dir=str(self.run_dir), mode=self.mode, command=self.command,
            exit_code=exit_code, outcome="success" if cause is None else cause.kind, started_at=self.started_at,
            duration_s=round(time.monotonic() - self.t0, 3), root_cause=cause,
            workers=last.workers if last else [], teardown_s=last.teardown_s if last else None, notes=self.notes,
            max_restarts=self.cfg.system.max_restarts, restarts=self.restarts_used, attempts=attempts,
            node_rank=self.rendezvous.node_rank, nnodes=self.rendezvous.nnodes, nodes=self.rendezvous.nodes,
            final_save=last.final_save if last else None,
            stragglers=self.stragglers, hang_timeouts=self.timeouts.learned(),
            suspect_devices=[d for a in attempts for d in a.suspect_devices],
            recoveries=self.recoveries,
            slurm_job_id=self.slurm_job_id, start=self.start, slurm_restart_count=self.requeue,
            requeues=self.earlier_starts,
            goodput=self.goodput.to_dict() if self.goodput else None,
        )
        if self.rendezvous.node_rank != 0:  # on disk before node 0 hears of this node's end (and may requeue the job)
            self._write_summary(summary)
        nodes = self._gather_outcomes(summary)
        summary.node_outcomes = nodes or []
        block = summary.block()
        if self.rendezvous.node_rank == 0:
            self._write_summary(summary)
        write_launcher_error_file(dict(os.environ), cause, summary.workers)
        logger.bind(file_only=True).info(block)  # the console gets it below, unprefixed
        if nodes is None:  # node 0 prints the job's one summary, this node's outcome in it
            block = (f"gpuherd: node {summary.node_rank} ended with exit {exit_code}; the job's summary is "
                     f"printed by node 0; this node's: {self.run_dir}/summary.json")
        self.console.write(STDERR, block.encode() + b"\n")
        if self.cfg.system.report:
            from supervisor.views import report_after_run  # matplotlib: only when a report is wanted

            html = report_after_run(self.run_dir)
            if html is not None:
                logger.info(f"report: {html} (figures beside it; `gpuherd report RUN RUN` compares runs)")
        else:  # not on the exit path: a scheduler, a restart or a Ctrl-C never waits for matplotlib
            logger.info(f"report: gpuherd report {self.run_dir} (HTML + figures from the run's files, "
                        "whenever you want them)")
        self._requeue_if_preempted(cause, summary)  # last: SLURM signals the job's processes then
        return exit_code

    def _write_summary(self, summary: Summary) -> None:
        try:
            summary.write(self.run_dir / "summary.json")
        except OSError as exc:  # the log disk failed: the summary goes to the console instead, whole
            logger.warning(f"summary.json could not be written to {self.run_dir} ({exc.strerror}): here it is")
            self.console.write(STDERR, summary.to_json() + b"\n")

    def _requeue_if_preempted(self, cause: RootCause | None, summary: Summary) -> None:
        """Node 0 of a preempted requeueable job, once every node has ended and written its
        summary: the requeue SLURM does not do for a job that stopped within its GraceTime."""
        job_id = os.environ.get("SLURM_JOB_ID")
        if self.rendezvous.node_rank != 0 or not job_id or cause is None or not cause.message.startswith(PREEMPTION):
            return
        requeued = requeue_after_preemption(job_id, job_info(job_id))
        if requeued is not None:
            logger.warning(requeued)
            summary.notes.append(requeued)
            self._write_summary(summary)


    def _gather_outcomes(self, summary: Summary) -> list[dict] | None:
        """Multi-node: every node's outcome on node 0, None on the others; [] on one node."""
        if self.rendezvous.nnodes < 2:
            return []
        mine = {"node": summary.node_rank, "host": socket.gethostname(), "exit_code": summary.exit_code,
                "outcome": summary.outcome, "final_save": summary.final_save, "run_dir": summary.run_dir}
        return self.rendezvous.gather_outcomes(mine)


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


def _stop_cause(signum: int, when: str) -> RootCause:
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return RootCause("interrupted", ExitCode.SIGINT, f"interrupted by Ctrl-C (SIGINT) {when}")
    return RootCause("terminated", stop_exit_code(signum), f"the supervisor received {name} {when}")


def _start_watchers(cfg: Config, plan: DevicePlan, run_dir: Path, sup: Supervision, att: Attempt,
                    workers: list[WorkerProcess]) -> list[RunWatcher]:
    def write_metric(record: dict) -> None:  # the straggler check reads the GPU/host samples too
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
