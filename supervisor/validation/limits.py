"""How many workers one supervisor can run, and whether the machine can run them.

`--nproc 100000` would otherwise create thousands of log files and then die of
"Too many open files"; `system.backend=nccl` on CPU workers would wait out the
rendezvous timeout before failing. Both are said before anything starts.
"""

from __future__ import annotations

import resource

from loguru import logger

from gpuherd.errors import LaunchError

MAX_WORKERS = 1024  # per node: far beyond any machine's GPUs; CPU workers past it only thrash
# The supervisor holds per worker: stdout, stderr and status pipes, its log file, and a few
# more while spawning; the rest is its own (logs, metrics, the store, the agent, NVML).
FDS_PER_WORKER = 8
FDS_BASE = 64


def check_worker_count(world_size: int) -> None:
    if world_size > MAX_WORKERS:
        raise LaunchError(f"--nproc {world_size} (system.nproc): one supervisor runs at most {MAX_WORKERS} workers; "
                             "use fewer, or more nodes (--nnodes)")


def ensure_open_files(world_size: int) -> None:
    """Raise the soft open-file limit when the workers need more and the hard limit allows it
    (as a shell's `ulimit -n` would); refuse when even the hard limit is too low."""
    need = FDS_BASE + FDS_PER_WORKER * world_size
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise LaunchError(f"{world_size} workers need about {need} open files, but this process may open only "
                             f"{hard} (ulimit -Hn); lower --nproc or raise the limit")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    logger.debug(f"open-file limit raised from {soft} to {need} for {world_size} workers")


def check_backend(backend: str, device_kind: str) -> None:
    """The built-in worker's process-group backend must fit the devices it gets."""
    if backend == "nccl" and device_kind != "cuda":
        raise LaunchError("system.backend=nccl needs CUDA GPUs, but this run's workers are on CPU (no usable GPU, "
                             "or system.device=cpu); use system.backend=gloo or auto")
