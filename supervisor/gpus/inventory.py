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

from supervisor.gpus import nvml


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory: int | None  # bytes; None where the driver does not say (WDDM)
    name: str = "?"  # process name, "?" when the pid is not visible (other container)
    user: str = "?"

    def describe(self) -> str:
        mem = "?" if self.used_memory is None else f"{self.used_memory / 1024**3:.1f} GiB"
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

    @property
    def short_uuid(self) -> str:
        """`GPU-1a2b3c4d`: enough to tell GPUs apart in a table (nvitop prints the same)."""
        return self.uuid[:12] if self.uuid else "?"

    def foreign_processes(self, ours: set[int] | frozenset[int] = frozenset()) -> tuple[GpuProcess, ...]:
        """Processes on this GPU that are not ours (we never count ourselves as busy)."""
        mine = set(ours) | {os.getpid()}
        return tuple(p for p in (self.processes or ()) if p.pid not in mine)


def read_inventory() -> list[GpuInfo]:
    """Every GPU NVML sees; raises nvml.NvmlUnavailable (with the reason) without NVML."""
    with nvml.session() as pynvml:
        return [describe_device(pynvml, index) for index in range(pynvml.nvmlDeviceGetCount())]


def describe_device(pynvml: ModuleType, index: int, handle: Any = None) -> GpuInfo:
    """One GpuInfo; a lost GPU is returned with `lost` set instead of raising, so one
    dead device never hides the healthy ones from a plan or a table."""
    try:
        handle = handle or pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        name = pynvml.nvmlDeviceGetName(handle)
        bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
        total, used, _free = nvml.memory_info(pynvml, handle)
    except pynvml.NVMLError as exc:
        if not nvml.is_lost(pynvml, exc):
            raise
        return GpuInfo(index=index, uuid="", name="?", pci_bus_id="?", memory_total=0, memory_used=0,
                       processes=None, lost=f"NVML: {exc}")
    return GpuInfo(index=index, uuid=uuid, name=name, pci_bus_id=_bus(bus), memory_total=total,
                   memory_used=used, processes=_processes(pynvml, handle))


def _bus(bus_id: Any) -> str:
    return bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)


def _processes(pynvml: ModuleType, handle: Any) -> tuple[GpuProcess, ...] | None:
    try:
        found = nvml.compute_processes(pynvml, handle)
    except Exception as exc:
        if nvml.is_unsupported(pynvml, exc):
            return None
        raise
    return tuple(process_info(pid, used) for pid, used in found)


def process_info(pid: int, used: int | None) -> GpuProcess:
    try:
        proc = psutil.Process(pid)
        return GpuProcess(pid, used, proc.name(), proc.username())
    except (psutil.Error, KeyError):  # KeyError: uid without a passwd entry (containers)
        return GpuProcess(pid, used)
