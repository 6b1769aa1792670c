"""One training job: its attempts, from the first spawn to the summary.

The attempt loop carries out what the attempt policy (attempt_policy.py, pure) decides:
run an attempt (attempt_run.py: rendezvous, exit 5 when a node never joins -> one worker per
device -> supervise to the end -> its report), check the dataset cache again (rebuilt if it
went missing or was damaged) when a restart depends on it, pause and restart (resuming from
the newest checkpoint this run wrote, without the suspect GPUs under --exclude-suspect-gpus),
or stop. The end (job_end.py): summary.json and the root-cause block. This file is the
wiring: it decides nothing about restarts itself.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from loguru import logger

from gpuherd import contract
from gpuherd import status_records as records
from gpuherd.exit_codes import ExitCode
from gpuherd.log_writes import LOG_WRITES
from supervisor import goodput
from supervisor import requeue as requeues
from supervisor.attempt_policy import (
    AttemptEnded,
    CheckDataset,
    DatasetChecked,
    Decision,
    Event,
    Interrupted,
    Restart,
    Rules,
    State,
    Stop,
    next_attempt,
    stop_cause,
)
from supervisor.attempt_run import AttemptOrder, AttemptRunner
from supervisor.cli import Launch
from supervisor.goodput import marks
from supervisor.gpus import DevicePlan
from supervisor.health import HangPolicy, LearnedTimeouts, MetricsSink, hang_timeouts, previous_learned
from supervisor.job_end import RunEnd
from supervisor.output import Console
from supervisor.processes import (
    OrphanGuard,
    StopSignal,
    become_subreaper,
    python_env,
    restarts_used,
    stops_raise,
    sweep_children,
)
from supervisor.rendezvous import Rendezvous, training_fingerprint
from supervisor.restarts import held_stop_signals, mark_excluded, pause
from supervisor.summary import AttemptReport, RootCause, Summary


class Job:
    def __init__(self, launch: Launch, plan: DevicePlan, run_id: str, run_dir: Path, command: list[str],
                 started_at: str, t0: float, console: Console, stop_timeout: float,
                 excluded: tuple[int, ...] = ()) -> None:
        """`console`: the one writer of everything the supervisor prints (main.py);
        `stop_timeout`: system.stop_timeout, shortened under SLURM to fit its KillWait;
        `excluded`: GPUs this host's suspect list left out of the plan at the start."""
        self.launch, self.run_id, self.run_dir = launch, run_id, run_dir
        self.cfg = launch.config
        self.command, self.started_at, self.t0 = command, started_at, t0
        self.console = console
        self.dataset_path = ""
        self.requeue = launch.requeue  # SLURM requeued the job this many times (SLURM_RESTART_COUNT)
        self.slurm_job_id = launch.slurm_job_id
        self.start = launch.start  # >= 1: a SLURM job started again (requeued or resubmitted): its run goes on here
        self.log_base = requeues.log_dir(run_dir, self.start)
        self.earlier_starts = requeues.earlier_starts(run_dir, self.start) if self.start else []
        self.timeouts = self._learned_timeouts(plan)
        self.attempts = AttemptRunner(launch, run_id, run_dir, command, console, stop_timeout, self.log_base,
                                      self.timeouts)
        system = self.cfg.system
        self.rules = Rules(max_restarts=system.max_restarts, train=self.mode == "train",
                           restart_on_nan=system.restart_on_nan, base_backoff=system.restart_backoff,
                           exclude_suspect_gpus=system.exclude_suspect_gpus, multi_node=launch.node.multi)
        self.state = State(plan=plan, excluded=excluded)  # the attempt policy's: streak, restarts used, recoveries, devices
        self.guard: OrphanGuard | None = None  # started before the dataset build (start_guard)
        self._released_guard: OrphanGuard | None = None  # told to exit; reaped just before ours (reap_helpers)
        self._reaping: threading.Thread | None = None  # reaps them while the summary is written (release_guard)
        self.dataset_s: float | None = None  # the first dataset build's seconds (goodput: `dataset`)
        self.goodput: goodput.Goodput | None = None  # the whole run's, every start's (summary.json)
        self.goodput_charts = goodput.GoodputScalars(run_dir)  # imports tensorboard's writer in the background
        self.timeline = goodput.TimelineReader(run_dir / "metrics.jsonl")  # every start's events, read as they come

    @property
    def mode(self) -> str:
        return "script" if self.launch.script else "train"

    @property
    def rendezvous(self) -> Rendezvous:
        """How this node meets the others (main.py sets it before the first attempt)."""
        return self.attempts.rendezvous

    @rendezvous.setter
    def rendezvous(self, rendezvous: Rendezvous) -> None:
        self.attempts.rendezvous = rendezvous

    def _learned_timeouts(self, plan: DevicePlan) -> LearnedTimeouts:
        """One learner for the whole job: a restart starts from what earlier attempts learned,
        a --resume from what the newest run with the same settings left in its run directory."""
        system = self.cfg.system
        hang, startup = hang_timeouts(self.cfg.preset, system.hang_timeout, system.startup_timeout,
                                      script=self.mode == "script")
        policy = HangPolicy(step_default=hang, startup=startup, factor=system.hang_factor, floor=system.hang_floor,
                            override=system.hang_timeout)
        fingerprint = f"{training_fingerprint(self.cfg)}-{self.mode}-{plan.world_size}"
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
            return stop_cause(stop.signum, "while preparing the dataset"), False
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
        `system.max_restarts` restarts are used up: the attempt policy's decisions, carried out."""
        guard = self.start_guard()
        metrics = MetricsSink(self.run_dir / "metrics.jsonl")
        metrics.write(marks.start(self.start, self.t0, self.dataset_s))
        attempts: list[AttemptReport] = []
        final: RootCause | None = None
        order = self._order(self._requeue_resume(metrics))
        try:
            while True:
                report = self.attempts.run(order, guard, metrics)
                ended = time.monotonic()
                attempts.append(report)
                decision = self._decide(self._ended(report))
                if isinstance(decision, CheckDataset):
                    failure, rebuilt = self.recheck_dataset()
                    decision = self._decide(DatasetChecked(failure.message if failure else None, rebuilt))
                if isinstance(decision, Stop):
                    final, report.not_restarted = decision.cause, decision.not_restarted
                    break
                signum = self._restart(decision, report, metrics, ended)
                if signum is not None:
                    final = self._decide(Interrupted(signum)).cause
                    break
                order = self._order(decision.resume)
        except KeyboardInterrupt:  # Ctrl-C in the instant between an attempt's handlers and the pause
            final = self._decide(Interrupted(signal.SIGINT, in_pause=False)).cause
        finally:
            # the helpers first: the store helper's death (the kernel unmaps its torch) and the guard's
            # exit then overlap the goodput account, its TensorBoard point and the summary's fsyncs
            self.attempts.retire_standbys(self.guard)
            self.release_guard(dying=self.attempts.store_server.close(wait=False))
            self.goodput = self._goodput_so_far(end_of_start=metrics)
            metrics.close()
        return self.finish(final, attempts)

    def _decide(self, event: Event) -> Decision:
        self.state, decision = next_attempt(self.state, event, self.rules)
        return decision

    def _ended(self, report: AttemptReport) -> AttemptEnded:
        """An attempt's report, as the policy reads it."""
        newest = self.attempts.checkpoints.newest_of_this_run()
        return AttemptEnded(report.root_cause, report.duration_s, stop_signal=report.stop_signal,
                            progressed=self.attempts.progress.made,
                            recovered=restarts_used(report.recoveries),  # live_policy's rule, as its budget
                            suspects=tuple(report.suspect_devices), newest=str(newest) if newest is not None else None,
                            saw=report.script_saves["said"] if report.script_saves is not None else None)

    def _order(self, resume: str | None) -> AttemptOrder:
        """The next attempt, as the policy's state has it."""
        s = self.state
        return AttemptOrder(s.attempt, resume, s.plan, s.restarts_used, s.live_budget(self.rules), s.excluded,
                            self.dataset_path)

    def _restart(self, restart: Restart, report: AttemptReport, metrics: MetricsSink, ended: float) -> int | None:
        """Say and record the restart, then pause what is left of the backoff since the attempt
        `ended`; a stop signal from the restart's announcement to the pause's end is returned."""
        with held_stop_signals() as held:
            return self._announce_and_pause(restart, report, metrics, ended, held)

    def _announce_and_pause(self, restart: Restart, report: AttemptReport, metrics: MetricsSink,
                            ended: float, held: list[int]) -> int | None:
        for line in restart.said:
            logger.warning(line)
        mark_excluded(report.suspect_devices, restart.exclude_gpus, restart.attempt)
        logger.warning(restart.message)
        metrics.write(records.Restart(
            time=time.time(), attempt=restart.attempt, after=restart.after.message, exit_code=restart.after.exit_code,
            resume=restart.resume, membership=restart.membership, restarts_used=self.state.restarts_used,
            excluded_gpus=tuple(self.state.excluded), world_size=restart.plan.world_size,
            script_save=report.script_saves["said"] if report.script_saves is not None else None))
        self._goodput_so_far()
        return pause(restart.delay, since=ended, held=held)

    def _goodput_so_far(self, end_of_start: MetricsSink | None = None) -> goodput.Goodput:
        """The whole run's goodput now (every start's), also a point in TensorBoard; at the end of
        a start, also its `goodput` record in metrics.jsonl."""
        events = self.timeline.events()
        now = time.time()
        account = goodput.account(events, now)
        self.goodput_charts.write(account, goodput.last_step(events), now)
        if end_of_start is not None:
            end_of_start.write({"type": "goodput", "time": now, **account.to_dict()})
            self.goodput_charts.close()
        return account

    def _requeue_resume(self, metrics: MetricsSink) -> str | None:
        """The first attempt of a SLURM job started again (requeued, or its script submitted
        again) resumes from the newest checkpoint its run saved so far."""
        if not self.start:
            return None
        newest = requeues.replay_checkpoints(self.run_dir, self.attempts.checkpoints)
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
            if self.rendezvous.helper_pid is None:  # nothing of ours left to end: reaped while the summary is written
                self._reaping = threading.Thread(target=self._reap_released, name="reap-helpers", daemon=True)
                self._reaping.start()

    def reap_helpers(self) -> None:
        """Last, just before the exit code: the store helper and the guard, ended earlier, are
        reaped: none of the launcher's processes outlives it. Where nothing else of ours was left
        (no node agent), a thread started at `release_guard` has been reaping them meanwhile: the
        waits for their exits (a time slice each on a busy node) and the cgroup's removal overlap
        the summary's writing and its fsyncs instead of following them."""
        if self._reaping is not None:
            self._reaping.join()
            self._reaping = None
        self._reap_released()

    def _reap_released(self) -> None:
        if self._released_guard is not None:  # first: the kernel's wait on the move overlaps the helper's death
            self._released_guard.step_out()
        self.attempts.store_server.reap()
        if self._released_guard is not None:
            self._released_guard.reap()
            self._released_guard = None

    def finish(self, cause: RootCause | None, attempts: list[AttemptReport]) -> int:
        exit_code = int(cause.exit_code) if cause is not None else 0
        last = attempts[-1] if attempts else None
        notes = self.attempts.notes
        if LOG_WRITES.note():
            notes.append(LOG_WRITES.note())
        if self.console.left_out:
            notes.append(f"the console fell behind: {self.console.left_out} line(s) were not shown there "
                         "(a terminal that stopped reading); every line is in the log files")
        summary = Summary(
            run_id=self.run_id, run_dir=str(self.run_dir), mode=self.mode, command=self.command,
            exit_code=exit_code, outcome="success" if cause is None else cause.kind, started_at=self.started_at,
            duration_s=round(time.monotonic() - self.t0, 3), root_cause=cause,
            workers=last.workers if last else [], teardown_s=last.teardown_s if last else None, notes=notes,
            max_restarts=self.cfg.system.max_restarts, restarts=self.state.restarts_used, attempts=attempts,
            node_rank=self.rendezvous.node_rank, nnodes=self.rendezvous.nnodes, nodes=self.rendezvous.nodes,
            final_save=last.final_save if last else None,
            stragglers=self.attempts.stragglers, hang_timeouts=self.timeouts.learned(),
            suspect_devices=[d for a in attempts for d in a.suspect_devices],
            recoveries=self.attempts.recoveries,
            slurm_job_id=self.slurm_job_id, start=self.start, slurm_restart_count=self.requeue,
            requeues=self.earlier_starts,
            goodput=self.goodput.to_dict() if self.goodput else None,
        )
        self.attempts.close_folding()
        RunEnd(self.rendezvous, self.console, self.run_dir, self.cfg.system.report).close(summary, cause)
        return exit_code
