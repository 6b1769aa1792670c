"""Which GPUs this machine has, keyed by NVML UUID, in nvidia-smi's (PCI bus) order.

NVML enumerates devices in PCI bus order, the order nvidia-smi shows; CUDA uses
the same order only under CUDA_DEVICE_ORDER=PCI_BUS_ID (its default,
FASTEST_FIRST, may reorder mixed GPUs). The supervisor therefore hands workers
that order plus the UUID it planned, and the worker checks the UUID it got.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import psutil
from loguru import logger

from supervisor.gpus import nvml, pids


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # as NVML reports it: the host's pid namespace
    used_memory: int | None  # bytes; None where the driver does not say (WDDM)
    name: str = "?"  # process name, "?" when the pid is not visible (other container)
    user: str = "?"
    visible: bool = True  # False: we run in a container, NVML's pid is not one of our /proc's

    def describe(self) -> str:
        mem = "?" if self.used_memory is None else f"{self.used_memory / 1024**3:.1f} GiB"
        if not self.visible:
            return f"pid {self.pid} (a host pid, owner unknown from inside this container) {mem}"
        return f"pid {self.pid} {self.name} ({self.user}) {mem}"


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index == nvidia-smi's id == CUDA id under CUDA_DEVICE_ORDER=PCI_BUS_ID
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int  # bytes
    memory_used: int  # bytes
    # compute processes holding memory when the inventory was read; None = unknown (unsupported)
    processes: tuple[GpuProcess, ...] | None = ()
    lost: str | None = None  # why the GPU cannot be used at all (fell off the bus), else None
    unusable: str | None = None  # healthy but not for us: no permission, MIG mode on

    @property
    def short_uuid(self) -> str:
        """`GPU-1a2b3c4d`: enough to tell GPUs apart in a table (nvitop prints the same)."""
        return self.uuid[:12] if self.uuid else "?"

    def foreign_processes(self, ours: set[int] | frozenset[int] = frozenset()) -> tuple[GpuProcess, ...]:
        """Processes on this GPU that are not ours (we never count ourselves as busy), matched
        by every pid ours have, the host's included (pids.py)."""
        mine = {alias for pid in (*ours, os.getpid()) for alias in pids.VIEW.aliases(pid)}
        return tuple(p for p in (self.processes or ()) if p.pid not in mine)


def read_inventory() -> list[GpuInfo]:
    """Every GPU NVML sees; raises nvml.NvmlUnavailable (with the reason) without NVML."""
    with nvml.session() as pynvml:
        return describe_all(pynvml)[0]


def describe_all(pynvml: ModuleType) -> tuple[list[GpuInfo], dict[int, Any]]:
    """Every GPU's GpuInfo, and the handles of those NVML could open (inside a session)."""
    opened, failed = nvml.handles(pynvml)
    gpus = [describe_device(pynvml, i, opened.get(i), failed.get(i)) for i in sorted({*opened, *failed})]
    return gpus, opened


def describe_device(pynvml: ModuleType, index: int, handle: Any, failed: nvml.HandleError | None = None) -> GpuInfo:
    """One GpuInfo; a GPU NVML cannot open or read is returned with `lost` or `unusable`
    set instead of raising, so one bad device never hides the healthy ones."""
    if failed is not None:
        logger.warning(f"GPU {index} cannot be used: {failed.reason}")
        return _unopened(index, **({"lost": failed.reason} if failed.lost else {"unusable": failed.reason}))
    try:
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        total, used, _free = nvml.memory_info(pynvml, handle)
        mig = nvml.mig_enabled(pynvml, handle)
    except pynvml.NVMLError as exc:
        if not nvml.is_lost(pynvml, exc):
            raise
        return _unopened(index, lost=f"NVML: {exc}")
    unusable = None
    if mig:  # CUDA would see only its MIG instances, and gpuherd plans whole GPUs
        unusable = (f"MIG mode is enabled; disable it (sudo nvidia-smi -i {index} -mig 0, then reset the GPU) "
                    "or choose a GPU without MIG")
    return GpuInfo(index=index, uuid=uuid, name=name, pci_bus_id=_bus(bus), memory_total=total,
                   memory_used=used, processes=_processes(pynvml, handle), unusable=unusable)


def _unopened(index: int, **why: str) -> GpuInfo:
    return GpuInfo(index=index, uuid="", name="?", pci_bus_id="?", memory_total=0, memory_used=0,
                   processes=None, **why)


def _bus(bus_id: Any) -> str:
    return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)


def _processes(pynvml: ModuleType, handle: Any) -> tuple[GpuProcess, ...] | None:
    try:
        found = nvml.compute_processes(pynvml, handle)
    except Exception as exc:
        if nvml.is_unsupported(pynvml, exc):
            return None
        raise
    if pids.VIEW.in_host_namespace():
        return tuple(process_info(pid, used) for pid, used in found)
    # in a container NVML's pids are the host's: a same-numbered process here is someone else
    return tuple(GpuProcess(pid, used, visible=False) for pid, used in found)


def process_info(pid: int, used: int | None) -> GpuProcess:
    try:
        proc = psutil.Process(pid)
        return GpuProcess(pid, used, proc.name(), proc.username())
    except (psutil.Error, KeyError):  # KeyError: uid without a passwd entry (containers)
        return GpuProcess(pid, used)
