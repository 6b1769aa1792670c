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
# Node 0 of a multi-node job serves every node: the job store holds two connections per node
# agent (its requests and its abort wait) and node 0's agent one liveness socket per node; the
# workers' store one connection per worker of every node (its process group's store client) and
# one more for a live recovery's or a spare's client. Its children (the store's process, the
# agent) inherit the limit this process sets.
FDS_PER_NODE = 3
FDS_PER_REMOTE_WORKER = 2


def check_worker_count(world_size: int) -> None:
    if world_size > MAX_WORKERS:
        raise LaunchError(f"--nproc {world_size} (system.nproc): one supervisor runs at most {MAX_WORKERS} workers; "
                             "use fewer, or more nodes (--nnodes)")


def open_files_needed(world_size: int, hosted_nodes: int = 0) -> int:
    """What one supervisor needs open at once: its own workers', and on node 0 of a job of
    `hosted_nodes` nodes (spare nodes included) the connections of every node and its workers."""
    remote = FDS_PER_NODE * hosted_nodes + FDS_PER_REMOTE_WORKER * world_size * hosted_nodes
    return FDS_BASE + FDS_PER_WORKER * world_size + remote


def ensure_open_files(world_size: int, hosted_nodes: int = 0) -> None:
    """Raise the soft open-file limit when the workers (and, on node 0, the nodes it serves)
    need more and the hard limit allows it (as a shell's `ulimit -n` would); refuse when even
    the hard limit is too low, before the join: a node 0 that ran out mid-join would drop nodes
    with "Too many open files" hundreds of nodes in."""
    need = open_files_needed(world_size, hosted_nodes)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise LaunchError(_too_few_files(world_size, hosted_nodes, need, hard))
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    whom = f"{world_size} workers" + (f" and the {hosted_nodes} nodes node 0 serves" if hosted_nodes else "")
    logger.debug(f"open-file limit raised from {soft} to {need} for {whom}")


def _too_few_files(world_size: int, hosted_nodes: int, need: int, hard: int) -> str:
    if not hosted_nodes:
        return (f"{world_size} workers need about {need} open files, but this process may open only "
                f"{hard} (ulimit -Hn); lower --nproc or raise the limit")
    return (f"node 0 of {hosted_nodes} nodes ({world_size} workers each) needs about {need} open files for the "
            f"job's connections, but this process may open only {hard} (ulimit -Hn); raise the hard limit on "
            f"node 0 to {need} or more (`ulimit -n {need}` where the hard limit allows, else nofile in "
            "limits.conf or `ulimit -Hn` as root; a systemd service's LimitNOFILE=; under SLURM, slurmd's "
            "LimitNOFILE=, with PropagateResourceLimits copying the submitting shell's `ulimit -n`)")


def check_backend(backend: str, device_kind: str) -> None:
    """The built-in worker's process-group backend must fit the devices it gets."""
    if backend == "nccl" and device_kind != "cuda":
        raise LaunchError("system.backend=nccl needs CUDA GPUs, but this run's workers are on CPU (no usable GPU, "
                             "or system.device=cpu); use system.backend=gloo or auto")
