"""Which devices this run uses, one worker each, in rank order.

GPU identity and order come from the GPU adapter (`supervisor.gpus.inventory`,
NVML index == nvidia-smi id == CUDA id under CUDA_DEVICE_ORDER=PCI_BUS_ID). The
set is narrowed, in this order, by an inherited CUDA_VISIBLE_DEVICES (ids or
UUIDs), by `system.device_id` (train_gpu.sh) or `--gpus`, and by an explicit
`--nproc N`. No GPU at all means `system.nproc` CPU workers and a one-line notice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuherd.config import SystemConfig
from supervisor.gpus.inventory import GpuInfo

# memory_used (NVML v2 excludes the driver's reservation) above this means another
# process holds the GPU; a fresh GPU reports a few MiB.
BUSY_BYTES = 1 << 30


class DevicePlanError(ValueError):
    """The requested devices cannot be used; one line for the user (exit 2)."""


@dataclass(frozen=True)
class DeviceSlot:
    rank: int
    kind: str  # "cuda" | "cpu"
    device_id: int  # physical id: nvidia-smi's GPU id, or CPU worker n
    uuid: str = ""  # NVML UUID, "" for CPU workers

    @property
    def tag(self) -> str:
        """`GPU3` / `CPU0`: the console prefix without the colon."""
        return f"{'GPU' if self.kind == 'cuda' else 'CPU'}{self.device_id}"


@dataclass(frozen=True)
class DevicePlan:
    slots: tuple[DeviceSlot, ...]
    isolate: bool  # each worker sees only its own GPU
    notice: str | None = None  # one line worth telling the user (CPU fallback)

    @property
    def kind(self) -> str:
        return self.slots[0].kind

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def visible_devices(self, slot: DeviceSlot) -> str | None:
        """CUDA_VISIBLE_DEVICES for this worker (None on CPU: hide nothing, set nothing)."""
        if slot.kind != "cuda":
            return None
        if self.isolate:
            return str(slot.device_id)
        return ",".join(str(s.device_id) for s in self.slots)


def plan_devices(
    system: SystemConfig,
    gpus: Sequence[GpuInfo] | None,
    cuda_visible_devices: str | None,
    nproc_explicit: bool,
    force: bool = False,
) -> DevicePlan:
    """Decide the workers; raises DevicePlanError (exit 2) before anything starts."""
    if system.device == "cpu":
        return _cpu_plan(system.nproc, None)
    allowed = _allowed_gpus(list(gpus or []), cuda_visible_devices)
    if not allowed:
        if system.device == "cuda":
            raise DevicePlanError("system.device=cuda but no GPU is visible "
                                  f"({_why_no_gpu(gpus, cuda_visible_devices)})")
        return _cpu_plan(system.nproc, f"no GPU found ({_why_no_gpu(gpus, cuda_visible_devices)}): "
                                       f"starting {system.nproc} CPU workers with gloo (--nproc N to change)")
    wanted = system.gpus if system.gpus is not None else (
        [system.device_id] if system.device_id is not None else None)
    if wanted is not None:
        by_id = {g.index: g for g in allowed}
        missing = [i for i in wanted if i not in by_id]
        if missing:
            raise DevicePlanError(
                f"GPU {', '.join(map(str, missing))} not available; usable GPUs: "
                f"{', '.join(str(g.index) for g in allowed)}"
                + (f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices})" if cuda_visible_devices is not None else ""))
        allowed = [by_id[i] for i in wanted]
    if nproc_explicit:
        if system.nproc > len(allowed):
            raise DevicePlanError(f"--nproc {system.nproc} asks for more workers than the {len(allowed)} "
                                  f"usable GPU(s) ({', '.join(str(g.index) for g in allowed)})")
        allowed = allowed[:system.nproc]
    busy = [g for g in allowed if g.memory_used > BUSY_BYTES]
    if busy and not force:
        g = busy[0]
        raise DevicePlanError(f"GPU {g.index} is busy: {g.memory_used / 2**30:.1f} GiB of memory held by "
                              "another process (--force to use it anyway)")
    slots = tuple(DeviceSlot(rank=r, kind="cuda", device_id=g.index, uuid=g.uuid) for r, g in enumerate(allowed))
    return DevicePlan(slots=slots, isolate=system.isolate)


def _cpu_plan(nproc: int, notice: str | None) -> DevicePlan:
    slots = tuple(DeviceSlot(rank=r, kind="cpu", device_id=r) for r in range(nproc))
    return DevicePlan(slots=slots, isolate=False, notice=notice)


def _allowed_gpus(gpus: list[GpuInfo], cvd: str | None) -> list[GpuInfo]:
    """GPUs CUDA_VISIBLE_DEVICES lets us use, in the order it lists them.

    Entries are nvidia-smi ids or (unique prefixes of) UUIDs, as CUDA accepts;
    like CUDA, the list ends at the first entry that names no GPU ("-1" hides all).
    """
    if cvd is None:
        return gpus
    chosen: list[GpuInfo] = []
    for raw in (part.strip() for part in cvd.split(",")):
        if not raw:
            break
        if raw.lstrip("-").isdigit():
            match = [g for g in gpus if g.index == int(raw)]
        else:
            match = [g for g in gpus if g.uuid.startswith(raw) or g.uuid.removeprefix("GPU-").startswith(raw)]
        if len(match) != 1 or match[0] in chosen:
            break
        chosen.append(match[0])
    return chosen


def _why_no_gpu(gpus: Sequence[GpuInfo] | None, cvd: str | None) -> str:
    if gpus is None:
        return "NVML unavailable"
    if not gpus:
        return "NVML lists none"
    return f"CUDA_VISIBLE_DEVICES={cvd!r} hides them all"
