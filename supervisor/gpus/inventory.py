"""Which GPUs this machine has, keyed by NVML UUID, in nvidia-smi's (PCI bus) order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML index == nvidia-smi's id == CUDA id under CUDA_DEVICE_ORDER=PCI_BUS_ID
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int  # bytes
    memory_used: int  # bytes


def list_gpus() -> list[GpuInfo] | None:
    """Every GPU NVML sees, or None when NVML is unavailable (no driver, CPU machine)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            gpus.append(GpuInfo(
                index=index,
                uuid=pynvml.nvmlDeviceGetUUID(handle),
                name=pynvml.nvmlDeviceGetName(handle),
                pci_bus_id=pynvml.nvmlDeviceGetPciInfo(handle).busId,
                memory_total=int(memory.total),
                memory_used=int(memory.used),
            ))
        return gpus
    finally:
        pynvml.nvmlShutdown()
