"""`gpuherd run` / `python -m supervisor`: one training job from command line to exit code.

resolve config (exit 2) -> plan devices (exit 2) -> the launch's paths and limits
(exit 2) -> pre-flight GPU and host checks (exit 4 / 2) -> run directory (one atomic
mkdir) + config.json -> dataset cache (exit 3; built-in trainer only) -> the job's
attempts (job.py) -> summary.json + root-cause block -> exit with the cause's code.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

import orjson
from loguru import logger

from gpuherd.cli import die
from gpuherd.config import Config
from gpuherd.exit_codes import ExitCode
from gpuherd.files import write_bytes_atomic
from gpuherd.log_writes import LOG_WRITES
from gpuherd.memory_plan import shard_copy_bytes
from gpuherd.model_checks import check_fits, check_processes_fit, check_vocab, host_memory_bytes, worker_memory
from gpuherd.storage import storage_errno, storage_message
from gpuherd.torch_floor import TorchTooOld, check_torch_version, installed_torch_version
from supervisor import requeue as requeues
from supervisor import run_dir as rundir
from supervisor.cli import PROG, Launch, parse
from supervisor.gpus import DeviceError, DevicePlan, plan_devices
from supervisor.health import (WARN, CheckReport, StartExclusion, SuspectList, announce_devices, at_start, avoid_listed,
                               hang_timeouts, list_path, run_checks)
from supervisor.job import Job
from supervisor.output import STDERR, Console
from supervisor.processes import (helper_preexec, ignored_notice, inherited_ignored, markers_notice, python_env,
                                  take_inherited_markers, why_off, within_kill_wait)
from supervisor.rendezvous import MultiNode, NodeLinkError, NodeSpec, SingleNode, bind_master, kill_wait
from supervisor.summary import now_iso
from supervisor.validation import LaunchError, validate_launch


def cli(argv: list[str] | None = None) -> NoReturn:
    """The `gpuherd run` / `python -m supervisor` process: main(), then exit_now()."""
    exit_now(main(argv))


def exit_now(code: int) -> NoReturn:
    """The launcher's last act once everything is written: flush, then leave without the
    interpreter's teardown. That teardown (a full garbage collection of the supervisor's
    heap, then every module's) did nothing anyone needs and took 50-150 ms on each exit,
    which a scheduler waiting for the exit code, a restart and a Ctrl-C all waited for.
    Nothing is lost: the workers and helpers are gone, summary.json was fsynced, the
    console's writer threads were joined, and removing the log sinks flushes them."""
    logger.remove()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    started_at, t0 = now_iso(), time.monotonic()
    launch = parse(list(sys.argv[1:] if argv is None else argv), prog)
    console = Console()  # everything the supervisor prints goes through it, its own lines too
    try:
        return _run(launch, console, started_at, t0)
    finally:
        console.close()


def _run(launch: Launch, console: Console, started_at: str, t0: float) -> int:
    inherited_ignored()  # read before any handler of ours exists: what the caller left ignored stays so
    markers = take_inherited_markers()  # before any process is started: none inherits a leftover marker
    _console_logging(launch.verbose, console, f"n{launch.node.node_rank}/" if launch.node.multi else "")
    cfg, node = launch.config, launch.node
    mode = "script" if launch.script else "train"
    if launch.script is None:  # the built-in trainer: a too-old torch is exit 2 here, not a crash in every worker
        _check_torch(console)
    plan, left_out = _plan(launch, console)
    try:  # before the pre-flight checks: they read these paths too, and would trip over a bad one
        validate_launch(cfg, plan, train=mode == "train", hosted_nodes=_hosted_nodes(node, cfg))
    except LaunchError as exc:
        _refuse(console, str(exc), exc.exit_code)
    run_id, run_dir = _run_names(launch, console)  # a bad --run-id is refused before any slower check
    # the arguments before the machine: a wrong --master-addr is named as such, never as a full disk
    listen, bind_ip = _bind_store(launch, console)
    vocab = _vocab_checks(cfg, console) if mode == "train" else None
    checks = _preflight(launch, plan, console, master_bound=listen is not None) if cfg.system.preflight else None
    if vocab is not None:  # last: a wrong flag above is named as such, not as a model that does not fit
        live = why_off(cfg, script=None, multi_node=node.multi, world_size=plan.world_size) is None
        _memory_checks(cfg, plan, vocab, cfg.system.spares if live else 0, console)
    # ---- nothing was written before this line; everything below may write
    _open_run_dir(launch, run_dir, checks, console)
    _notices(launch, left_out, markers)
    command = launch.script.command() if launch.script else [sys.executable, "-m", "worker"]
    logger.debug(f"run {run_id}: {mode} mode, {plan.world_size} worker(s) on "
                 f"{', '.join(s.tag for s in plan.slots)}; isolate={plan.isolate}; command: {' '.join(command)}")
    if plan.notice:
        logger.info(plan.notice)
    announce_devices(plan)

    job = Job(launch, plan, run_id, run_dir, command, started_at, t0, console, _stop_timeout(cfg.system.stop_timeout),
              excluded=left_out.gpus)
    job.start_guard()  # before any helper or the dataset build starts a process: none outlives us, ever
    rendezvous = _rendezvous(launch, mode, run_id, run_dir, listen, bind_ip)
    if rendezvous is not None:  # else the single node's default
        job.rendezvous = rendezvous
    try:
        if mode == "train":
            failure = job.prepare_dataset()
            if failure is not None:
                job.release_guard()
                return job.finish(job.rendezvous.fail_before_start(failure), [])
        return job.run()
    finally:
        job.rendezvous.close()
        job.release_guard()  # a no-op unless the run ended before its attempts
        job.reap_helpers()  # the exit code comes after every process the launcher started is gone


def _check_torch(console: Console) -> None:
    """A torch older than the trainer needs: one line and its exit code."""
    try:
        check_torch_version(installed_torch_version())
    except TorchTooOld as exc:
        _refuse(console, str(exc), exc.exit_code)


def _rendezvous(launch: Launch, mode: str, run_id: str, run_dir: Path, listen: socket.socket | None,
                bind_ip: str | None) -> SingleNode | MultiNode | None:
    """The job's rendezvous where it is not the default one: torchrun's store flags on one node
    (served from the socket bound at the start, held for the job; every attempt serves from
    it), or a multi-node job's agent (it imports torch while the dataset is prepared)."""
    cfg, node = launch.config, launch.node
    if not node.multi:
        return SingleNode(launch.store, listen) if listen is not None else None
    hang, _ = hang_timeouts(cfg.preset, cfg.system.hang_timeout, cfg.system.startup_timeout, script=mode == "script")
    agent = MultiNode(node, cfg, mode, run_id, run_dir, bind_ip, listen, python_env(),
                      helper_preexec(), finish_wait=max(60.0, hang), run_id_given=bool(launch.run_id))
    if listen is not None:
        listen.close()  # the agent holds it now
    return agent


def _notices(launch: Launch, left_out: StartExclusion, markers: dict[str, str]) -> None:
    """What to say about the launch, once the run directory (so supervisor.log) is open."""
    for notice in [*launch.notices, ignored_notice()]:
        if notice:
            logger.info(notice)
    for line in [markers_notice(markers), *left_out.said]:
        if line:
            logger.warning(line)


def _open_run_dir(launch: Launch, run_dir: Path, checks: CheckReport | None, console: Console) -> None:
    """logs/<run-id>/ with config.json, preflight.json and supervisor.log (exit 2 if it cannot be had)."""
    try:
        # one mkdir: of two runs with one --run-id, one wins; a SLURM job started again continues its own run
        rundir.create(run_dir, exist_ok=launch.force or launch.start > 0)
        rundir.hold(run_dir)  # until this process ends: no second start of the run meanwhile
        write_bytes_atomic(run_dir / "config.json", launch.config.to_json() + b"\n")
        if checks is not None:
            write_bytes_atomic(run_dir / "preflight.json", orjson.dumps(checks.to_dict(), option=orjson.OPT_INDENT_2))
    except rundir.RunDirError as exc:
        _refuse(console, str(exc), exc.exit_code)
    except OSError as exc:  # nothing trained yet: a full or read-only log disk is one line, exit 7
        code = storage_errno(exc)
        if code is None:
            raise
        _refuse(console, storage_message("the run's config", run_dir, code, None), ExitCode.STORAGE)
    for item in checks.of(WARN) if checks is not None else []:
        logger.warning(f"pre-flight: {item.line()}")
    # from here a failing log disk drops log lines (counted, said once on the console), never the run
    LOG_WRITES.on_first_failure(lambda message: console.write(STDERR, f"supervisor:WARNING | {message}\n".encode()))
    path = run_dir / "supervisor.log"
    fd = LOG_WRITES.open(path)
    logger.add(lambda message: LOG_WRITES.write(fd, str(message).encode(errors="backslashreplace"), path),
               level="DEBUG", enqueue=False, format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} | {message}")


def _vocab_checks(cfg: Config, console: Console) -> int:
    """The built-in model against its tokenizer (an argument error, exit 2): the tokenizer's
    vocabulary size."""
    from dataset_cache import DatasetError, load_tokenizer

    try:
        vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
    except DatasetError as exc:
        _refuse(console, str(exc), exc.exit_code)
    problem = check_vocab(cfg, vocab)
    if problem is not None:
        _refuse(console, problem)
    return vocab


def _memory_checks(cfg: Config, plan: DevicePlan, vocab: int, spares: int, console: Console) -> None:
    """For CPU workers, the model against this host's RAM: refused here (exit 2) rather than by
    every worker after the spawn (also a pre-flight item; this holds under --skip-checks too).
    On GPUs the worker's layout planner picks a sharding that fits or refuses in one line itself.
    Then every process the node starts (workers and warm spares) against the host's RAM, with the
    shard copies an FSDP worker keeps in host memory for live recovery."""
    model_bytes = copy_bytes = 0
    if plan.kind == "cpu":
        problem = check_fits(cfg, host_memory_bytes(plan.world_size), world_size=plan.world_size,
                             tokenizer_vocab=vocab, where=f"this host (available RAM / {plan.world_size} workers)")
        if problem is not None:
            _refuse(console, problem)
        model_bytes = worker_memory(cfg, plan.world_size, vocab).total
    if spares and cfg.training.strategy == "fsdp" and cfg.system.shard_copies:
        copy_bytes = shard_copy_bytes(worker_memory(cfg, plan.world_size, vocab).params, plan.world_size)
    problem = check_processes_fit(plan.world_size, spares, model_bytes, host_memory_bytes(), copy_bytes)
    if problem is not None:
        _refuse(console, problem)


def _run_names(launch: Launch, console: Console) -> tuple[str, Path]:
    """The run id and directory (checked free): exit 2 with one line for a bad --run-id or a
    taken directory."""
    cfg, node = launch.config, launch.node
    try:
        run_id = rundir.check_run_id(launch.run_id) if launch.run_id else rundir.new_run_id()
        # one directory per node: nodes sharing a filesystem (and a --run-id) never mix their files
        run_dir = rundir.run_dir_path(cfg.system.run_root, run_id if not node.multi else f"{run_id}-node{node.node_rank}")
        if launch.slurm_job_id is not None and (run_dir.is_dir() and not run_dir.is_symlink()):
            launch.start = requeues.next_start(run_dir)  # requeued, or its script submitted again
            changed = requeues.changed_model(run_dir, cfg) if launch.script is None else None
            if changed:
                raise rundir.RunDirError(f"run {run_id} in {run_dir} continues with another model ({changed}) than "
                                         "its checkpoints hold: start it with the settings it was started with, or "
                                         "start a new run (another --run-id)")
        rundir.ensure_free(run_dir, launch.force or launch.start > 0)
    except rundir.RunDirError as exc:
        _refuse(console, str(exc), exc.exit_code)
    except OSError as exc:  # the existing run directory cannot be read
        _refuse(console, f"cannot read run directory {run_dir}: {exc.strerror or exc}")
    return run_id, run_dir


def _hosted_nodes(node: NodeSpec, cfg: Config) -> int:
    """How many nodes this node's stores serve: every node of the job (spare nodes too) on node 0
    of a multi-node job, none elsewhere."""
    return node.nnodes + cfg.system.spare_nodes if node.multi and node.node_rank == 0 else 0


def _bind_store(launch: Launch, console: Console) -> tuple[socket.socket | None, str | None]:
    """The store's socket where this node hosts one at a chosen address (multi-node node 0, or
    torchrun's flags on one node), bound before anything is written: a wrong address or a
    busy port is one line and exit 2, never a timeout."""
    node = launch.node
    try:
        if node.multi and node.node_rank == 0:
            return bind_master(node.master_addr, node.master_port)
        if not node.multi and launch.store is not None:
            return bind_master(launch.store.bind_addr, launch.store.port)
    except NodeLinkError as exc:
        _refuse(console, str(exc), exc.exit_code)
    return None, None


def _refuse(console: Console, message: str, code: int = ExitCode.USAGE) -> NoReturn:
    """One line and the exit code (gpuherd.cli.die), after the lines the console still
    holds: they were logged first, so they are printed first."""
    console.flush()
    die(message, code)


def _console_logging(verbose: bool, console: Console, node: str = "") -> None:
    """The supervisor's own lines take the workers' way to the terminal: a terminal that
    stops reading never blocks the loop that judges heartbeats and sends SIGKILL on time.
    `node`: "n1/" on a multi-node job, whose nodes' output often ends up in one file."""
    logger.remove()
    logger.add(lambda message: console.write(STDERR, str(message).encode(errors="replace")),
               level="DEBUG" if verbose else "INFO", format=node + "supervisor:{level} | {message}", colorize=False,
               filter=lambda record: not record["extra"].get("file_only"))


def _stop_timeout(configured: float) -> float:
    """system.stop_timeout; under SLURM, over before SLURM's KillWait when scontrol can say it,
    so the final saves end before SLURM's SIGKILL does."""
    if not os.environ.get("SLURM_JOB_ID"):
        return configured
    wait = kill_wait()
    if wait is None:
        logger.debug(f"SLURM's KillWait is unknown (scontrol show config failed): stop timeout {configured:g} s")
        return configured
    limited = within_kill_wait(configured, wait)
    if limited < configured:
        logger.info(f"stop timeout {limited:g} s instead of {configured:g} s: SLURM kills a job {wait:g} s after "
                    "its SIGTERM (KillWait)")
    return limited


def _plan(launch: Launch, console: Console) -> tuple[DevicePlan, StartExclusion]:
    """The devices, chosen without the GPUs on this host's suspect list (unless
    --allow-suspect-gpus; an explicit --gpus naming one is refused, exit 2; every GPU listed is
    exit 8), and what to say about the list once the run directory exists."""
    cfg = launch.config
    system = cfg.system
    listed = SuspectList.load(list_path(system.run_root))
    explicit = system.gpus is not None or system.device_id is not None
    avoid = avoid_listed(listed) if listed.gpus() and not (system.allow_suspect_gpus or explicit) else None
    try:
        plan = plan_devices(system, os.environ.get("CUDA_VISIBLE_DEVICES"),
                            nproc_explicit=launch.nproc_explicit, force=launch.force, avoid=avoid)
        found = at_start(plan, listed, allow=system.allow_suspect_gpus, explicit=explicit)
    except DeviceError as exc:
        _refuse(console, str(exc), exc.exit_code)
    for rank in cfg.system.log_ranks or []:
        if rank >= plan.world_size and not launch.node.multi:  # multi-node: global ranks, known at the join
            _refuse(console, f"--log-ranks {rank}: this run has ranks 0-{plan.world_size - 1}")
    return plan, found


def _preflight(launch: Launch, plan: DevicePlan, console: Console, master_bound: bool) -> CheckReport:
    """The `gpuherd check` items for this run, before anything is written: a FAIL stops the run.
    `master_bound`: the store's port is ours already (the item says so instead of probing it)."""
    node = launch.node
    try:
        report = run_checks(launch.config, [g.index for g in plan.gpus] if plan.kind == "cuda" else [],
                            master=(node.master_addr, node.master_port) if node.multi else None,
                            node_rank=node.node_rank, script=launch.script is not None,
                            cpu_workers=plan.world_size if plan.kind == "cpu" else 0,
                            master_bound=master_bound)
    except DeviceError as exc:
        _refuse(console, str(exc), exc.exit_code)
    failure = report.first_failure()
    if failure is not None:
        _refuse(console, f"pre-flight check failed: {failure.line()} (`gpuherd check` shows every item; "
                         "--skip-checks to start anyway)", report.failed_exit_code)
    return report  # its warnings are told once the run really starts: a refused launch stays one line
