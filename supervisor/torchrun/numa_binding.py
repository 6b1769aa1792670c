"""torchrun's `--numa-binding MODE` applied to a run: each GPU worker's CPUs and memory.

The CPU sets come from supervisor/gpus/numa.py. A worker starts under `numactl
--physcpubind=CPUS --membind=NODES` where numactl is installed (its memory then stays on
its node too); without numactl its CPU affinity is set right after the spawn (before it
starts a thread: threads inherit it), memory unbound, said once. CPU workers have no GPU to
be near: the flag has no effect on them, said once.
"""

from __future__ import annotations

import shutil

from loguru import logger

from supervisor.gpus import Binding, DeviceError, DevicePlan, numa_bindings


def numa_plan(mode: str | None, plan: DevicePlan, first: bool = True) -> list[Binding]:
    """One binding per slot of `plan` (rank order), or [] when nothing is bound. `first`: the
    first attempt, which says what was bound; restarts bind the same way silently."""
    if mode is None:
        return []
    if plan.kind != "cuda":
        if first:
            logger.info(f"--numa-binding {mode}: CPU workers, no GPU to bind near: no effect here")
        return []
    try:
        bindings = numa_bindings(mode, [(gpu.index, gpu.pci_bus_id) for gpu in plan.gpus])
    except DeviceError as exc:
        logger.warning(f"{exc}: workers start unbound")
        return []
    if first:
        how = "numactl" if shutil.which("numactl") else "CPU affinity only (numactl not found: memory not bound)"
        logger.info(f"--numa-binding {mode} ({how}): " + "; ".join(
            f"{slot.tag}: {b.describe()}" for slot, b in zip(plan.slots, bindings)))
    return bindings


def bound(binding: Binding | None, command: list[str]) -> list[str]:
    """The command under numactl where it binds this worker."""
    if binding is None or not shutil.which("numactl"):
        return command
    return [*binding.numactl(), *command]
