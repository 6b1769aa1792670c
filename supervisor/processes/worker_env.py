"""The environment each worker starts with (docs/reference/environment.md).

torchrun's variables, so scripts and frameworks that detect a torchrun launch run
unchanged, then gpuherd's own. NCCL's error handling is torch's default
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3: a failed collective ends the process without
ncclCommAbort, which can hang), unless the user set it. The rendezvous store is hosted by the supervisor
(TORCHELASTIC_USE_AGENT_STORE=True: every rank is a client, as under torchrun).

Which environment a worker starts from: the built-in worker and the helper processes
get the checkout on PYTHONPATH (`python_env`); a user's script gets the user's own
environment (`script_env`), so its imports resolve exactly as under torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuherd import contract
from supervisor import REPO_ROOT
from supervisor.gpus import DevicePlan, DeviceSlot
from supervisor.processes.error_file import ERROR_FILE_VAR

# The launch scripts (scripts/python.sh) put the checkout first on PYTHONPATH for gpuherd's
# own imports and name the entry they added here, so a script gets the user's PYTHONPATH back.
WRAPPER_PYTHONPATH = "GPUHERD_WRAPPER_PYTHONPATH"

FR_ENTRIES = "2000"  # flight-recorder ring size per process: torch's own default in 2.13


@dataclass(frozen=True)
class RunEnv:
    """What is the same for every worker of one run."""

    run_id: str
    run_dir: str
    master_addr: str
    master_port: int
    supervisor_pid: int
    config_path: str = ""
    dataset_cache: str = ""
    restart_count: int = 0  # which attempt this is (--max-restarts)
    max_restarts: int = 0
    resume: str = ""  # a restarted attempt's checkpoint ("" = as configured)
    world_size: int = 0  # every node's workers (0: this node's only)
    node_rank: int = 0
    nnodes: int = 1
    trace_dir: str = ""  # this attempt's collective-trace directory (GPUHERD_TRACE_DIR)
    role: str = "default"  # ROLE_NAME (torchrun's --role)
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # TORCHELASTIC_SIGNALS_TO_HANDLE, torchrun's default
    virtual_local_rank: bool = False  # torchrun's --virtual-local-rank: LOCAL_RANK=0, one GPU visible
    timer_file: str = ""  # TORCHELASTIC_TIMER_FILE: the file timer server's pipe (TORCHELASTIC_ENABLE_FILE_TIMER=1)


def worker_env(base: Mapping[str, str], plan: DevicePlan, slot: DeviceSlot, run: RunEnv,
               status_fd: int, error_file: str | None = None) -> dict[str, str]:
    """`error_file`: this rank's TORCHELASTIC_ERROR_FILE (torch's `@record` writes it). None of
    gpuherd's own markers (contract.INTERNAL_VARS) is taken from `base`: each is this worker's own
    or absent, never one left in the environment of whoever started the supervisor."""
    env = {name: value for name, value in base.items() if name not in contract.INTERNAL_VARS}
    env.update(_torchrun_env(plan, slot, run))
    env.update({
        contract.GPU_RANK: str(slot.device_id),
        contract.DEVICE_KIND: slot.kind,
        contract.DEVICE_ID: str(slot.device_id),
        contract.DEVICE_UUID: slot.uuid,
        contract.CONFIG_PATH: run.config_path,
        contract.RUN_DIR: run.run_dir,
        contract.DATASET_CACHE: run.dataset_cache,
        contract.STATUS_FD: str(status_fd),
        contract.SUPERVISOR_PID: str(run.supervisor_pid),
        contract.SUPERVISED: "1",
        # Python-level stacks on SIGSEGV/SIGABRT/SIGBUS land in the worker's log.
        "PYTHONFAULTHANDLER": base.get("PYTHONFAULTHANDLER", "1"),
        # Lines reach the supervisor as they are printed, not when a 8 KiB buffer fills.
        "PYTHONUNBUFFERED": "1",
        contract.TRACE_DIR: run.trace_dir,
    })
    if error_file:
        env[ERROR_FILE_VAR] = error_file
    else:
        env.pop(ERROR_FILE_VAR, None)  # never a file of whoever started the supervisor
    env.update(flight_recorder_env(base, run.trace_dir))
    if run.timer_file:
        env["TORCHELASTIC_TIMER_FILE"] = run.timer_file
    if run.resume:
        env[contract.RESUME] = run.resume
    env.update(_device_env(base, plan, slot, run.virtual_local_rank))
    threads = omp_threads(base, slot.kind, plan.world_size)
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    return env


def _torchrun_env(plan: DevicePlan, slot: DeviceSlot, run: RunEnv) -> dict[str, str]:
    """The variables torchrun gives its workers, with the same names and meanings, so a
    script written for torchrun reads its rank, world and store the same way here."""
    world = str(run.world_size or plan.world_size)
    return {
        "RANK": str(slot.rank),
        "LOCAL_RANK": "0" if run.virtual_local_rank else str(slot.local),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": str(plan.world_size),
        "GROUP_RANK": str(run.node_rank),
        "GROUP_WORLD_SIZE": str(run.nnodes),
        "ROLE_RANK": str(slot.rank),
        "ROLE_NAME": run.role,
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": run.master_addr,
        "MASTER_PORT": str(run.master_port),
        "TORCHELASTIC_RUN_ID": run.run_id,
        "TORCHELASTIC_RESTART_COUNT": str(run.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(run.max_restarts),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": run.signals_to_handle,
    }


def _device_env(base: Mapping[str, str], plan: DevicePlan, slot: DeviceSlot, virtual_local_rank: bool) -> dict:
    """The GPUs a worker sees: its own (isolated), or the plan's; with torchrun's
    --virtual-local-rank on CPU workers, the CUDA_VISIBLE_DEVICES torchrun would set."""
    visible = plan.visible_devices(slot)
    if visible is not None:
        # CUDA_DEVICE_ORDER forced, not a default: the ids in CUDA_VISIBLE_DEVICES are NVML's (PCI bus order)
        return {**contract.cuda_defaults(base), "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": visible}
    if virtual_local_rank:
        listed = base.get("CUDA_VISIBLE_DEVICES")
        return {"CUDA_VISIBLE_DEVICES": listed.split(",")[slot.local].strip() if listed else str(slot.local)}
    return {}


def omp_threads(base: Mapping[str, str], kind: str, local_workers: int) -> str | None:
    """OMP_NUM_THREADS for a worker, None to leave it unset. The user's value always wins. As
    torchrun: 1 with several workers, unset for a lone one (it may use every core). Unlike
    torchrun, several CPU workers get cores / workers each: they share the cores instead of
    each running on one while the others idle (docs/guide/torchrun.md)."""
    if "OMP_NUM_THREADS" in base or local_workers <= 1:
        return None
    if kind == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return str(max(1, cores // local_workers))
    return "1"


def flight_recorder_env(base: Mapping[str, str], trace_dir: str) -> dict[str, str]:
    """PyTorch's flight recorder (the last collectives of every process group, NCCL and, in
    torch 2.13, gloo too) on, with NCCL's own dump on a watchdog timeout landing in the run
    directory rather than /tmp. torch 2.13 names: the TORCH_NCCL_* spellings of the buffer
    size and dump file warn as deprecated on every rank. What the user set wins."""
    wanted = {"TORCH_FR_BUFFER_SIZE": FR_ENTRIES, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if trace_dir:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(Path(trace_dir) / "nccl-timeout" / "rank")
    return {name: base.get(name, value) for name, value in wanted.items()}


def python_env() -> dict[str, str]:
    """Our environment with the repo importable (`python -m worker`, the helper processes)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])
    return env


def script_env() -> dict[str, str]:
    """The user's environment for their script: PYTHONPATH as they set it, without the
    checkout the launch script put in front (a user package named `worker` is theirs)."""
    env = dict(os.environ)
    added = env.pop(WRAPPER_PYTHONPATH, None)
    if added is not None:
        paths = env.get("PYTHONPATH", "").split(os.pathsep)
        if paths[0] == added:
            paths = paths[1:]
        if any(paths):
            env["PYTHONPATH"] = os.pathsep.join(paths)
        else:
            env.pop("PYTHONPATH", None)
    return env
