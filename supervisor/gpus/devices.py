"""Which devices this run uses, one worker each, in rank order.

GPU identity, order, CUDA_VISIBLE_DEVICES handling, busy checks and claims all
come from the GPU adapter (`supervisor.gpus.plan_gpus`): NVML index ==
nvidia-smi id == CUDA id under CUDA_DEVICE_ORDER=PCI_BUS_ID. This module turns
its answer into worker slots: `system.gpus` (`--gpus`) or `system.device_id`
(train_gpu.sh) pick GPUs, an explicit `--nproc N` takes the first N, and no GPU
at all means `system.nproc` CPU workers with a one-line notice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gpuherd.config import SystemConfig
from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode
from supervisor.gpus.inventory import GpuInfo
from supervisor.gpus.plan import plan_gpus
from supervisor.gpus.shared import no_gpu_to_share, shared_gpu_request, shared_warning


@dataclass(frozen=True)
class DeviceSlot:
    rank: int
    kind: str  # "cuda" | "cpu"
    device_id: int  # physical id: nvidia-smi's GPU id, or CPU worker n
    uuid: str = ""  # NVML UUID, "" for CPU workers
    local_rank: int | None = None  # on this node, when `rank` is global (multi-node); None: the same as rank

    @property
    def local(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank

    @property
    def tag(self) -> str:
        """`GPU3` / `CPU0`: the console prefix without the colon."""
        return f"{'GPU' if self.kind == 'cuda' else 'CPU'}{self.device_id}"


@dataclass(frozen=True)
class DevicePlan:
    slots: tuple[DeviceSlot, ...]
    isolate: bool  # each worker sees only its own GPU
    notice: str | None = None  # one line worth telling the user (CPU fallback)
    gpus: tuple[GpuInfo, ...] = ()  # NVML's record of each planned GPU, in rank order
    shared: bool = False  # system.shared_gpu_for_tests: every rank on the one GPU of `gpus` (shared.py)
    warning: str | None = None  # one WARNING line the run starts with (a shared GPU)

    @property
    def kind(self) -> str:
        return self.slots[0].kind

    @property
    def world_size(self) -> int:
        return len(self.slots)

    def with_rank_offset(self, offset: int) -> DevicePlan:
        """This node's slots with global ranks (multi-node: node r's first rank is `offset`)."""
        slots = tuple(replace(s, rank=offset + s.local, local_rank=s.local) for s in self.slots)
        return replace(self, slots=slots)

    def visible_devices(self, slot: DeviceSlot) -> str | None:
        """CUDA_VISIBLE_DEVICES for this worker (None on CPU: hide nothing, set nothing)."""
        if slot.kind != "cuda":
            return None
        if self.isolate or self.shared:
            return str(slot.device_id)
        return ",".join(str(s.device_id) for s in self.slots)


def plan_devices(
    system: SystemConfig,
    cuda_visible_devices: str | None,
    nproc_explicit: bool,
    force: bool = False,
    avoid: Callable[[GpuInfo], str | None] | None = None,
) -> DevicePlan:
    """Decide the workers before anything starts; raises DeviceError (exit 2 for a
    wrong request or a busy GPU, 4 for broken hardware, 8 when `avoid` leaves no GPU).
    `avoid`: why a GPU is not to be chosen automatically (this host's suspect list), else None."""
    if system.shared_gpu_for_tests:
        return _shared_plan(system, cuda_visible_devices, force)
    if system.device == "cpu":
        return _cpu_plan(system.nproc, None)
    requested = system.gpus if system.gpus is not None else (
        [system.device_id] if system.device_id is not None else None)
    first = system.nproc if requested is None and nproc_explicit else None
    gpus = plan_gpus(requested, cuda_visible_devices, force, first=first, avoid=avoid)
    if not gpus:
        why = (f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides every GPU"
               if cuda_visible_devices is not None else "NVML unavailable or no GPU")
        if system.device == "cuda":
            raise DeviceError(f"system.device=cuda but no GPU is usable ({why})", ExitCode.USAGE)
        return _cpu_plan(system.nproc, f"no GPU found ({why}): starting {system.nproc} CPU workers "
                                       "with gloo (--nproc N to change)")
    slots = tuple(DeviceSlot(rank=r, kind="cuda", device_id=g.index, uuid=g.uuid) for r, g in enumerate(gpus))
    return DevicePlan(slots=slots, isolate=system.isolate, gpus=tuple(gpus))


def exclude_gpus(plan: DevicePlan, gpu_ids: set[int]) -> DevicePlan:
    """The plan without these GPUs, one worker per GPU left, ranks renumbered in the order
    kept (the next attempt's world size shrinks). Their claims stay held for the run: a
    GPU left out as flaky should not be the free GPU another gpuherd run picks meanwhile.
    Raises DeviceError (exit 8, the suspect-device code) when no GPU would be left."""
    if plan.kind != "cuda":
        return plan
    kept = [s for s in plan.slots if s.device_id not in gpu_ids]
    if not kept:
        raise DeviceError(f"--exclude-suspect-gpus: no GPU left for another attempt: every GPU this attempt ran on "
                          f"is suspect ({', '.join(f'GPU {s.device_id}' for s in plan.slots)}); check them "
                          "(`gpuherd check`, nvidia-smi) before running again", ExitCode.DEVICE_SUSPECT)
    slots = tuple(replace(s, rank=r, local_rank=None) for r, s in enumerate(kept))
    return replace(plan, slots=slots, gpus=tuple(g for g in plan.gpus if g.index not in gpu_ids))


def _shared_plan(system: SystemConfig, cuda_visible_devices: str | None, force: bool) -> DevicePlan:
    """system.nproc ranks on one GPU, each seeing it alone (tests only: shared.py)."""
    requested = shared_gpu_request(system)
    gpus = plan_gpus(requested, cuda_visible_devices, force, first=1 if requested is None else None)
    if not gpus:
        raise no_gpu_to_share(cuda_visible_devices)
    gpu = gpus[0]
    slots = tuple(DeviceSlot(rank=r, kind="cuda", device_id=gpu.index, uuid=gpu.uuid) for r in range(system.nproc))
    return DevicePlan(slots=slots, isolate=True, gpus=(gpu,), shared=True,
                      warning=shared_warning(system.nproc, gpu.index))


def _cpu_plan(nproc: int, notice: str | None) -> DevicePlan:
    slots = tuple(DeviceSlot(rank=r, kind="cpu", device_id=r) for r in range(nproc))
    return DevicePlan(slots=slots, isolate=False, notice=notice)
