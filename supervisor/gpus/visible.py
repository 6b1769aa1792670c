"""CUDA_VISIBLE_DEVICES as the set of GPUs this job may use (a SLURM/K8s allocation).

Entries are NVML indices (the ids nvidia-smi shows) or UUIDs, full or a unique
prefix (`GPU-1a2b`), as CUDA accepts them. Where CUDA silently truncates the
list at the first bad entry, we name the entry and stop: a typo in an
allocation must not quietly shrink a run.
"""

from __future__ import annotations

from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode
from supervisor.gpus.inventory import GpuInfo


def allowed_gpus(gpus: list[GpuInfo], allowed_env: str | None) -> list[GpuInfo]:
    """The GPUs CUDA_VISIBLE_DEVICES allows, in its order; None/unset allows all."""
    if allowed_env is None:
        return list(gpus)
    text = allowed_env.strip()
    if text in ("", "-1", "none", "NoDevFiles"):
        return []  # how schedulers say "no GPU for this job"
    chosen: list[GpuInfo] = []
    for entry in (e.strip() for e in text.split(",")):
        gpu = _resolve(gpus, entry, allowed_env)
        if gpu in chosen:
            raise DeviceError(f"CUDA_VISIBLE_DEVICES={allowed_env} names GPU {gpu.index} twice", ExitCode.USAGE)
        chosen.append(gpu)
    return chosen


def _resolve(gpus: list[GpuInfo], entry: str, allowed_env: str) -> GpuInfo:
    where = f"CUDA_VISIBLE_DEVICES={allowed_env}"
    if entry.isdigit():
        for gpu in gpus:
            if gpu.index == int(entry):
                return gpu
        raise DeviceError(f"{where}: GPU {entry} does not exist ({_have(gpus)})", ExitCode.USAGE)
    if entry.startswith("MIG-"):
        raise DeviceError(f"{where}: MIG instance {entry} is not supported; give whole GPUs", ExitCode.USAGE)
    if entry.startswith("GPU-") and len(entry) > 4:
        matches = [g for g in gpus if g.uuid.lower().startswith(entry.lower())]
        if len(matches) == 1:
            return matches[0]
        why = "matches no GPU" if not matches else f"matches GPUs {', '.join(str(g.index) for g in matches)}"
        raise DeviceError(f"{where}: UUID {entry} {why} ({_have(gpus)})", ExitCode.USAGE)
    raise DeviceError(f"{where}: '{entry}' is neither a GPU id nor a GPU-<uuid>", ExitCode.USAGE)


def _have(gpus: list[GpuInfo]) -> str:
    if not gpus:
        return "this machine has no GPU"
    return f"this machine has GPUs 0-{len(gpus) - 1}" if len(gpus) > 1 else "this machine has GPU 0"
