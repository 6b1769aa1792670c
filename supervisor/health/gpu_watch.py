"""The GPU adapter joined to a run: the device table at start, topology warnings
before a multi-GPU run, and the NVML monitor as a run watcher whose fatal causes
(lost GPU, hardware XID, double-bit ECC) tear the run down with exit code 4."""

from __future__ import annotations

from loguru import logger

from supervisor.gpus import DevicePlan, GpuMonitor, NvmlUnavailable, format_device_table, read_topology
from supervisor.health.watchers import FatalCause, RunContext


def announce_devices(plan: DevicePlan) -> None:
    """Show the devices the run will use, and warn about slow GPU pairs before a multi-GPU run
    (or, once, that its ranks share one GPU: tests only)."""
    if plan.warning:
        logger.warning(plan.warning)
    gpus = list(plan.gpus)
    if not gpus:
        return
    rank_of_gpu = {s.device_id: s.rank for s in plan.slots}
    for line in format_device_table(gpus, rank_of_gpu).splitlines():
        logger.info(line)
    if len(gpus) > 1:
        try:
            for warning in read_topology([g.index for g in gpus]).warnings():
                logger.warning(warning)
        except NvmlUnavailable as exc:
            logger.debug(f"topology not read: {exc}")


class GpuWatcher:
    """Samples every planned GPU (and each worker's host CPU/memory) into metrics.jsonl."""

    name = "gpu-monitor"

    def __init__(self) -> None:
        self._monitor: GpuMonitor | None = None

    def start(self, ctx: RunContext) -> None:
        rank_of_gpu = {s.device_id: s.rank for s in ctx.plan.slots if s.kind == "cuda"}

        def fatal(message: str, code: int) -> None:
            ctx.report_fatal(FatalCause("gpu", code, message))

        self._monitor = GpuMonitor(
            list(ctx.plan.gpus), rank_of_gpu, lambda: dict(ctx.pids), ctx.write_metric,
            warn=logger.warning, fatal=fatal, interval=ctx.config.system.monitor_interval,
        )
        self._monitor.start()

    def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.stop()


def gpu_watcher(ctx: RunContext) -> GpuWatcher:
    return GpuWatcher()
