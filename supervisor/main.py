"""`python -m supervisor`: one training job from command line to exit code.

resolve config (exit 2) -> plan devices (exit 2) -> run directory + config.json ->
dataset cache (exit 3; built-in trainer only) -> the job's attempts (job.py) ->
summary.json + root-cause block -> exit with the cause's code.
"""

from __future__ import annotations

import os
import sys
import time

from loguru import logger

from gpuherd.cli import die
from gpuherd.files import write_bytes_atomic
from gpuherd.torch_floor import TorchTooOld, check_torch_version, installed_torch_version
from supervisor import run_dir as rundir
from supervisor.cli import Launch, parse
from supervisor.gpus import DeviceError, DevicePlan, plan_devices
from supervisor.health import announce_devices, hang_timeouts
from supervisor.job import Job
from supervisor.processes import die_with_parent, python_env
from supervisor.rendezvous import MultiNode, NodeLinkError, bind_master
from supervisor.summary import now_iso


def main(argv: list[str] | None = None) -> int:
    started_at, t0 = now_iso(), time.monotonic()
    launch = parse(list(sys.argv[1:] if argv is None else argv))
    _console_logging(launch.verbose)
    cfg = launch.config
    if launch.script is None:  # the built-in trainer: a too-old torch is exit 2 here, not a crash in every worker
        try:
            check_torch_version(installed_torch_version())
        except TorchTooOld as exc:
            die(str(exc), exc.exit_code)
    plan = _plan(launch)
    node = launch.node
    try:
        run_id = rundir.check_run_id(launch.run_id) if launch.run_id else rundir.new_run_id()
        # one directory per node: nodes sharing a filesystem (and a --run-id) never mix their files
        run_dir = rundir.run_dir_path(cfg.system.run_root, run_id if not node.multi else f"{run_id}-node{node.node_rank}")
        rundir.ensure_free(run_dir, launch.force)
    except rundir.RunDirError as exc:
        die(str(exc))
    listen, bind_ip = None, None
    if node.multi and node.node_rank == 0:
        try:
            listen, bind_ip = bind_master(node.master_addr, node.master_port)
        except NodeLinkError as exc:
            die(str(exc), exc.exit_code)
    # ---- nothing was written before this line; everything below may write
    rundir.create(run_dir)
    write_bytes_atomic(run_dir / "config.json", cfg.to_json() + b"\n")
    logger.add(run_dir / "supervisor.log", level="DEBUG", enqueue=False,
               format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} | {message}")
    mode = "script" if launch.script else "train"
    command = _command(launch)
    logger.debug(f"run {run_id}: {mode} mode, {plan.world_size} worker(s) on "
                 f"{', '.join(s.tag for s in plan.slots)}; isolate={plan.isolate}; command: {' '.join(command)}")
    if plan.notice:
        logger.info(plan.notice)
    announce_devices(plan)

    job = Job(launch, plan, run_id, run_dir, command, started_at, t0)
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


def _command(launch: Launch) -> list[str]:
    if launch.script is not None:
        return [sys.executable, "-u", str(launch.script), *launch.script_args]
    return [sys.executable, "-m", "worker"]


