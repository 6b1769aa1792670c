"""plan_gpus: from the user's request to the GPUs this run will use, checked and claimed.

Ids are always physical: the id nvidia-smi shows (NVML index, PCI bus order),
whether or not CUDA_VISIBLE_DEVICES is set; CUDA_VISIBLE_DEVICES only limits
which of them may be used. Rank r runs on the r-th GPU of the returned list
(the order the user gave, else the allowed order).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode
from supervisor.gpus import claim, nvml
from supervisor.gpus.inventory import GpuInfo, read_inventory
from supervisor.gpus.visible import allowed_gpus

# Claims of this process, held until it exits (flock dies with the process).
_held: dict[str, claim.GpuClaim] = {}


def plan_gpus(
    requested: list[int] | None,
    allowed_env: str | None,
    force: bool,
    *,
    first: int | None = None,
    lock_dir: Path | None = None,
    avoid: Callable[[GpuInfo], str | None] | None = None,
) -> list[GpuInfo]:
    """The GPUs to run on, claimed for the life of this process.

    requested None: every allowed GPU ([] when NVML is unavailable or nothing is
    allowed: the caller falls back to CPU workers). Raises DeviceError:
    exit 2 for an id that does not exist or is not allowed, a duplicate id,
    a malformed CUDA_VISIBLE_DEVICES, GPUs requested without NVML/GPU, `first`
    larger than the allowed GPUs; ExitCode.BUSY_GPU for one held by another
    process or claimed by another gpuherd run (unless force); exit 4 for a lost GPU.

    `first=N` (with requested None): the first N allowed GPUs, from the same
    inventory read. `avoid(gpu)`: why a GPU is not to be chosen (this host's suspect list),
    else None; it only narrows the automatic choice (requested None), so `--nproc N` still
    gets N GPUs where N healthy ones are allowed; every allowed GPU avoided is exit 8.
    """
    if requested is not None and not requested:
        raise DeviceError("--gpus is empty: name at least one GPU id", ExitCode.USAGE)
    try:
        inventory = read_inventory()
    except nvml.NvmlUnavailable as exc:
        if requested is None:
            return []
        raise DeviceError(f"GPU {_ids(requested)} requested but no GPU is usable: {exc}", ExitCode.USAGE) from None
    allowed = allowed_gpus(inventory, allowed_env)
    if requested is None:
        chosen = _automatic(_avoided(_without_unusable(allowed), avoid), first)
    else:
        chosen = [_pick(inventory, allowed, allowed_env, gpu_id) for gpu_id in _unique(requested)]
    _refuse_unusable(chosen)
    if not force:
        _refuse_busy(chosen, requested is None)
    _claim(chosen, force, lock_dir)
    return chosen


def _automatic(allowed: list[GpuInfo], first: int | None) -> list[GpuInfo]:
    """The automatic choice (no --gpus): every usable allowed GPU, or the first `first` of them."""
    if first is None or not allowed:
        return allowed
    if first > len(allowed):
        raise DeviceError(f"--nproc {first} asks for more workers than the {len(allowed)} usable GPU(s) "
                          f"({_ids([g.index for g in allowed])})", ExitCode.USAGE)
    return allowed[:first]


def _refuse_unusable(chosen: list[GpuInfo]) -> None:
    """A chosen GPU that is lost (exit 4) or otherwise unusable (exit 2) ends the plan here."""
    for gpu in chosen:
        if gpu.lost:
            raise DeviceError(f"GPU {gpu.index} cannot be used: it is lost ({gpu.lost}); "
                              "check `nvidia-smi` and dmesg for XID errors", ExitCode.DEVICE)
        if gpu.unusable:
            raise DeviceError(f"GPU {gpu.index} cannot be used: {gpu.unusable}", ExitCode.USAGE)


def release_claims() -> None:
    """Drop this process's claims (tests; a long-lived caller that planned twice)."""
    for held in _held.values():
        held.release()
    _held.clear()


def _without_unusable(allowed: list[GpuInfo]) -> list[GpuInfo]:
    """Every allowed GPU but those we may not use (each was named when the inventory was
    read); if that leaves none, the first one's reason is the error."""
    usable = [g for g in allowed if not g.unusable]
    if allowed and not usable:
        first = allowed[0]
        raise DeviceError(f"no usable GPU: GPU {first.index} cannot be used: {first.unusable}"
                          + (f" (and {len(allowed) - 1} more)" if len(allowed) > 1 else ""), ExitCode.USAGE)
    return usable


def _avoided(allowed: list[GpuInfo], avoid: Callable[[GpuInfo], str | None] | None) -> list[GpuInfo]:
    """The allowed GPUs `avoid` has nothing against; none left is exit 8 (the suspect-device code)."""
    if avoid is None:
        return allowed
    kept = [g for g in allowed if avoid(g) is None]
    if allowed and not kept:
        raise DeviceError(f"no GPU left to choose from {_ids([g.index for g in allowed])}: {avoid(allowed[0])}"
                          + (f" (and {len(allowed) - 1} more)" if len(allowed) > 1 else ""), ExitCode.DEVICE_SUSPECT)
    return kept


def _pick(inventory: list[GpuInfo], allowed: list[GpuInfo], allowed_env: str | None, gpu_id: int) -> GpuInfo:
    if gpu_id < 0 or gpu_id >= len(inventory):
        have = f"GPUs 0-{len(inventory) - 1}" if len(inventory) > 1 else "GPU 0" if inventory else "no GPU"
        raise DeviceError(f"GPU {gpu_id} does not exist: this machine has {have} (see nvidia-smi)", ExitCode.USAGE)
    gpu = inventory[gpu_id]
    if gpu not in allowed:
        ids = ", ".join(str(g.index) for g in allowed) or "none"
        raise DeviceError(f"GPU {gpu_id} is not in CUDA_VISIBLE_DEVICES={allowed_env} (allowed GPUs: {ids})",
                          ExitCode.USAGE)
    return gpu


def _unique(requested: list[int]) -> list[int]:
    seen = [i for n, i in enumerate(requested) if i in requested[:n]]
    if seen:
        raise DeviceError(f"--gpus names GPU {seen[0]} twice", ExitCode.USAGE)
    return list(requested)


def _refuse_busy(chosen: list[GpuInfo], all_by_default: bool) -> None:
    for gpu in chosen:
        others = gpu.foreign_processes()
        if others:
            held = sum(p.used_memory or 0 for p in others) / 1024**3
            hint = "pick free GPUs with --gpus, " if all_by_default else ""
            raise DeviceError(
                f"GPU {gpu.index} is busy: {len(others)} other process(es) hold {held:.1f} GiB "
                f"({'; '.join(p.describe() for p in others[:3])}); {hint}use ./train_auto_gpu.sh, "
                "or --force to share it", ExitCode.BUSY_GPU)


def _claim(chosen: list[GpuInfo], force: bool, lock_dir: Path | None) -> None:
    _held.update(claim.inherited_claims(directory=lock_dir))
    os.environ.pop(claim.CLAIM_FDS_ENV, None)  # never hand the claim fds' numbers to workers
    new: list[str] = []
    for gpu in chosen:
        if gpu.uuid in _held:
            continue
        got = claim.try_claim(gpu.uuid, lock_dir)
        if got is not None:
            _held[gpu.uuid] = got
            new.append(gpu.uuid)
        elif not force:
            holder = claim.claim_holder(gpu.uuid, lock_dir)
            who = f"pid {holder}" if holder else "another process"
            for uuid in new:  # all or nothing
                _held.pop(uuid).release()
            raise DeviceError(f"GPU {gpu.index} is claimed by another gpuherd run ({who}); "
                              "wait for it, choose another GPU, or --force to share it", ExitCode.USAGE)


def _ids(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)
