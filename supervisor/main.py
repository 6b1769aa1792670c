"""`gpuherd run` / `python -m supervisor`: one training job from command line to exit code.

resolve config (exit 2) -> plan devices (exit 2) -> run directory + config.json ->
dataset cache (exit 3; built-in trainer only) -> the job's attempts (job.py) ->
summary.json + root-cause block -> exit with the cause's code.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import orjson
from loguru import logger

from gpuherd.cli import die
from gpuherd.files import write_bytes_atomic
from supervisor import run_dir as rundir
from supervisor.cli import PROG, Launch, parse
from supervisor.gpus import DeviceError, DevicePlan, plan_devices
from supervisor.health import WARN, CheckReport, announce_devices, hang_timeouts, run_checks
from supervisor.job import Job
from supervisor.processes import die_with_parent, python_env
from supervisor.rendezvous import MultiNode, NodeLinkError, SingleNode, bind_master
from supervisor.summary import now_iso


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    started_at, t0 = now_iso(), time.monotonic()
    launch = parse(list(sys.argv[1:] if argv is None else argv), prog)
    _console_logging(launch.verbose)
    cfg = launch.config
    plan = _plan(launch)
    node = launch.node
    checks = _preflight(launch, plan) if cfg.system.preflight else None
    try:
        run_id = rundir.check_run_id(launch.run_id) if launch.run_id else rundir.new_run_id()
        # one directory per node: nodes sharing a filesystem (and a --run-id) never mix their files
        run_dir = rundir.run_dir_path(cfg.system.run_root, run_id if not node.multi else f"{run_id}-node{node.node_rank}")
        rundir.ensure_free(run_dir, launch.force)
    except rundir.RunDirError as exc:
        die(str(exc))
    listen, bind_ip = _bind_store(launch)
    # ---- nothing was written before this line; everything below may write
    rundir.create(run_dir)
    write_bytes_atomic(run_dir / "config.json", cfg.to_json() + b"\n")
    if checks is not None:
        write_bytes_atomic(run_dir / "preflight.json", orjson.dumps(checks.to_dict(), option=orjson.OPT_INDENT_2))
    logger.add(run_dir / "supervisor.log", level="DEBUG", enqueue=False,
               format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} | {message}")
    for notice in launch.notices:
        logger.info(notice)
    mode = "script" if launch.script else "train"
    command = launch.script.command() if launch.script else [sys.executable, "-m", "worker"]
    logger.debug(f"run {run_id}: {mode} mode, {plan.world_size} worker(s) on "
                 f"{', '.join(s.tag for s in plan.slots)}; isolate={plan.isolate}; command: {' '.join(command)}")
    if plan.notice:
        logger.info(plan.notice)
    announce_devices(plan)

    job = Job(launch, plan, run_id, run_dir, command, started_at, t0)
    if not node.multi and listen is not None:
        job.rendezvous = SingleNode(launch.store, listen)  # held for the job; every attempt serves from it
    if node.multi:  # the agent imports torch while the dataset is prepared
        hang, _ = hang_timeouts(cfg.preset, cfg.system.hang_timeout, cfg.system.startup_timeout,
                                script=mode == "script")
        job.rendezvous = MultiNode(node, cfg, mode, run_id, run_dir, bind_ip, listen, python_env(),
                                   die_with_parent(), finish_wait=max(60.0, hang))
        if listen is not None:
            listen.close()  # the agent holds it now
    try:
        if mode == "train":
            failure = job.prepare_dataset()
            if failure is not None:
                return job.finish(job.rendezvous.fail_before_start(failure), [])
        return job.run()
    finally:
        job.rendezvous.close()


def _bind_store(launch: Launch) -> tuple[socket.socket | None, str | None]:
    """The store's socket, where this node hosts one at a chosen address (multi-node node 0, or
    torchrun's flags on one node), bound before anything is written: a wrong address or a
    busy port is one line and exit 2, never a timeout."""
    node = launch.node
    try:
        if node.multi and node.node_rank == 0:
            return bind_master(node.master_addr, node.master_port)
        if not node.multi and launch.store is not None:
            return bind_master(launch.store.bind_addr, launch.store.port)
    except NodeLinkError as exc:
        die(str(exc), exc.exit_code)
    return None, None


def _console_logging(verbose: bool) -> None:
    logger.remove()
    logger.add(sys.stderr, level="DEBUG" if verbose else "INFO", format="supervisor:{level} | {message}",
               colorize=False, filter=lambda record: not record["extra"].get("file_only"))


def _plan(launch: Launch) -> DevicePlan:
    cfg = launch.config
    try:
        plan = plan_devices(cfg.system, os.environ.get("CUDA_VISIBLE_DEVICES"),
                            nproc_explicit=launch.nproc_explicit, force=launch.force)
    except DeviceError as exc:
        die(str(exc), exc.exit_code)
    for rank in cfg.system.log_ranks or []:
        if rank >= plan.world_size and not launch.node.multi:  # multi-node: global ranks, known at the join
            die(f"--log-ranks {rank}: this run has ranks 0-{plan.world_size - 1}")
    return plan


def _preflight(launch: Launch, plan: DevicePlan) -> CheckReport:
    """The `gpuherd check` items for this run, before anything is written or bound (the
    master-port item would otherwise find node 0's own socket): a FAIL stops the run."""
    node = launch.node
    try:
        report = run_checks(launch.config, [g.index for g in plan.gpus] if plan.kind == "cuda" else [],
                            master=(node.master_addr, node.master_port) if node.multi else None,
                            node_rank=node.node_rank)
    except DeviceError as exc:
        die(str(exc), exc.exit_code)
    for item in report.of(WARN):
        logger.warning(f"pre-flight: {item.line()}")
    failure = report.first_failure()
    if failure is not None:
        die(f"pre-flight check failed: {failure.line()} (`gpuherd check` shows every item; --skip-checks "
            "to start anyway)", report.failed_exit_code)
    logger.debug(f"pre-flight checks: {report.counts()}")
    return report
