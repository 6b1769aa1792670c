"""The device table printed at start and by `python -m supervisor.commands.select_gpu`."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.gpus.inventory import GpuInfo

GIB = 1024**3


def format_device_table(
    gpus: Sequence[GpuInfo],
    rank_of_gpu: dict[int, int] | None = None,
    extra: dict[int, dict[str, str]] | None = None,
) -> str:
    """rank | GPU | name | memory used/total | UUID (short) | PCI bus | other processes.

    `rank_of_gpu` (GPU index -> rank) adds the rank column; `extra` (GPU index ->
    {column: text}) appends columns, e.g. the selector's utilization average.
    """
    extra = extra or {}
    extra_cols = list(dict.fromkeys(col for cols in extra.values() for col in cols))
    header = (["rank"] if rank_of_gpu is not None else []) + ["GPU", "name", "memory", "UUID", "PCI bus"]
    header += extra_cols + ["other processes"]
    rows = []
    for gpu in gpus:
        row = [str(rank_of_gpu.get(gpu.index, "-"))] if rank_of_gpu is not None else []
        if gpu.lost or not gpu.uuid:  # lost, or NVML would not open it at all
            row += [str(gpu.index), "LOST" if gpu.lost else "NO ACCESS", "-", "-", "-"]
        else:
            row += [str(gpu.index), gpu.name, f"{gpu.memory_used / GIB:.1f}/{gpu.memory_total / GIB:.1f} GiB",
                    gpu.short_uuid, gpu.pci_bus_id]
        row += [extra.get(gpu.index, {}).get(col, "") for col in extra_cols]
        row.append(_processes(gpu))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _processes(gpu: GpuInfo) -> str:
    if gpu.lost or gpu.unusable:
        return gpu.lost or gpu.unusable
    if gpu.processes is None:
        return "n/a"
    others = gpu.foreign_processes()
    return "; ".join(p.describe() for p in others) or "-"
