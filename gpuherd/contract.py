"""Supervisor -> worker environment contract (docs/reference/environment.md).

torchrun-compatible variables first, so scripts and frameworks that detect a
torchrun launch (Lightning, accelerate) run unchanged; gpuherd's own after.
Both sides import the names from here; tests/gpuherd/test_contract.py pins them.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

# torchrun's variables (torch/distributed/elastic/agent/server/local_elastic_agent.py)
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)

GPU_RANK = "GPU_RANK"  # the physical GPU id shown in the [GPU n] tag
DEVICE_KIND = "GPUHERD_DEVICE_KIND"  # "cuda" or "cpu"
DEVICE_ID = "GPUHERD_DEVICE_ID"  # physical device id (GPU index as nvidia-smi shows it, or CPU worker n)
DEVICE_UUID = "GPUHERD_DEVICE_UUID"  # NVML UUID the supervisor planned for this worker ("" on CPU)
CONFIG_PATH = "GPUHERD_CONFIG"  # the resolved config JSON of this run
RUN_DIR = "GPUHERD_RUN_DIR"  # logs/<run-id>/
DATASET_CACHE = "GPUHERD_DATASET_CACHE"  # the verified cache directory the supervisor prepared
STATUS_FD = "GPUHERD_STATUS_FD"  # write end of the status pipe (orjson lines)
SUPERVISOR_PID = "GPUHERD_SUPERVISOR_PID"  # for the parent-death check
SUPERVISED = "GPUHERD_SUPERVISED"  # "1": the supervisor prefixes our lines
RESUME = "GPUHERD_RESUME"  # set on a restarted attempt: the checkpoint to resume from (overrides training.resume)
TRACE_DIR = "GPUHERD_TRACE_DIR"  # where a rank dumps its collective trace when the supervisor asks (gpuherd/liveness.py)
LIVE_RECOVERY = "GPUHERD_LIVE_RECOVERY"  # "1": a warm spare stands by; a rank that loses a peer rejoins a rebuilt group
SPARE = "GPUHERD_SPARE"  # "1": a warm spare: import, map the dataset, then wait on stdin for the rank it replaces
STANDBY = "GPUHERD_STANDBY"  # "1": a --script rank's restart standby: import torch, then wait on stdin for its rank
SPARE_SOURCE_FD = "GPUHERD_SPARE_SOURCE_FD"  # a script's spare source: forks warm spares on this socket
# a spare's warm-up priority (its warm-up thread's nice value): absent, 19 (it takes only the CPU the
# ranks leave idle); "0" where a shrunk group waits for it to grow back (worker/spare.py)
SPARE_WARM_UP_NICE = "GPUHERD_SPARE_WARM_UP_NICE"
JOIN_GENERATION = "GPUHERD_JOIN_GENERATION"  # in a spare's assignment: the rebuilt group it joins (1, 2, ...)
# Set by a user, never by gpuherd: a test fault, RANK:STEP:TARGET (worker/sdc/injector.py)
INJECT_BITFLIP = "GPUHERD_INJECT_BITFLIP"
SHRINK = "GPUHERD_SHRINK"  # "1": after a lost peer, read the supervisor's decision (a spare, or shrink) first
# that decision, in the workers' store (MASTER_ADDR:MASTER_PORT): {"spare": lost rank},
# {"shrink": lost rank, "ranks": [the surviving ranks, in order: their ranks in the shrunk group]},
# or {"regrow": carried rank, "ranks": [...]} (a warm spare takes it back at a step boundary)
DECISION_KEY = "gpuherd-live/{generation}/decision"
# a regrow's answer from the shrunk group's first rank, which the newcomer waits for: "go" (the
# group rebuilds with it at this step boundary) or "ended" (training ended first: it exits 0)
REGROW_KEY = "gpuherd-live/{generation}/regrow"

# What the supervisor sends gpuherd's own worker (worker/signals.py). Real-time signals, which no
# shell, terminal or SLURM ever sends: SLURM signals every process of a job step on scancel, a
# preemption or the time limit, so a worker's own SIGTERM/SIGINT/SIGHUP/SIGUSR1/SIGUSR2 can only be
# a stop request, never the supervisor's "exit now". A --script keeps torchrun's SIGTERM/SIGUSR1.
TEARDOWN_SIGNAL = signal.SIGRTMIN  # the run is being torn down: exit now, no collectives, no save
STACKS_SIGNAL = signal.SIGRTMAX  # a hang verdict: dump every thread's Python stack, training goes on

GPUHERD_VARS = (
    GPU_RANK, DEVICE_KIND, DEVICE_ID, DEVICE_UUID, CONFIG_PATH, RUN_DIR, DATASET_CACHE,
    STATUS_FD, SUPERVISOR_PID, SUPERVISED, RESUME, TRACE_DIR, LIVE_RECOVERY, SPARE, STANDBY, JOIN_GENERATION,
    SHRINK, SPARE_SOURCE_FD, SPARE_WARM_UP_NICE,
)
# Every one of them is gpuherd's marker for a process it starts, never a user setting: one found in
# the supervisor's own environment (exported in a shell, copied from a worker's environment, a
# debugger, a job template) is named, removed, and never inherited by a worker, a spare or a standby
# (a worker inheriting GPUHERD_STANDBY=1 waits for a rank nobody sends and exits 0 having run nothing).
INTERNAL_VARS = frozenset(GPUHERD_VARS)


# Set for every CUDA process gpuherd starts (supervised workers and pretrain_main.py)
# unless the user set them: ids mean nvidia-smi's ids, and the caching allocator grows
# segments instead of fragmenting (PyTorch's own advice for training; newer torch also
# reads PYTORCH_ALLOC_CONF, so a user setting under either name wins).
CUDA_DEFAULTS = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
_SAME_SETTING = {"PYTORCH_CUDA_ALLOC_CONF": ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}


def cuda_defaults(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The CUDA_DEFAULTS `env` does not already decide."""
    return {name: value for name, value in CUDA_DEFAULTS.items()
            if not any(alias in env for alias in _SAME_SETTING.get(name, (name,)))}


def same_device_uuid(a: str, b: str) -> bool:
    """NVML writes `GPU-<hex>`, torch's device properties give `<hex>`: one GPU either way."""
    def norm(uuid: str) -> str:
        return uuid.strip().lower().removeprefix("gpu-")

    return bool(a and b) and norm(a) == norm(b)


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this process is, read from the environment (standalone: rank 0 of 1)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device_kind: str  # "cuda" | "cpu" | "" (standalone: decide from torch)
    device_id: int  # physical id, for the tag
    supervised: bool

    @property
    def tag(self) -> str:
        """`GPU3` / `CPU0`: the console line prefix, without its colon."""
        return f"{'CPU' if self.device_kind == 'cpu' else 'GPU'}{self.device_id}"

    @property
    def bracket(self) -> str:
        """`[GPU 3]` / `[CPU 0]`: the tag inside step, NaN and error messages."""
        return f"[{'CPU' if self.device_kind == 'cpu' else 'GPU'} {self.device_id}]"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorkerIdentity:
        env = dict(os.environ if env is None else env)
        rank = int(env.get("RANK", "0"))
        local_rank = int(env.get("LOCAL_RANK", str(rank)))
        device_id = env.get(DEVICE_ID) or env.get(GPU_RANK) or str(local_rank)
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))),
            device_kind=env.get(DEVICE_KIND, ""),
            device_id=int(device_id),
            supervised=env.get(SUPERVISED) == "1",
        )
