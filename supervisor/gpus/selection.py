"""select_least_used: the GPU an auto-selecting run should take, claimed before returning.

Ranking, best first: no foreign processes, not throttling, lowest utilization
averaged over `window_s` (one snapshot lies: NVML's utilization is the share of
the last sample period a kernel ran), most free memory (GiB), then a random
tie-break so identical idle GPUs spread jobs out. Candidates are claimed in
that order; one claimed by another gpuherd run is skipped, so two jobs started
together get different GPUs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode
from supervisor.gpus import claim, nvml, nvml_meaning
from supervisor.gpus.inventory import GpuInfo, describe_all
from supervisor.gpus.table import format_device_table
from supervisor.gpus.visible import allowed_gpus

SAMPLE_EVERY = 0.1  # seconds between utilization reads inside the window


@dataclass
class Candidate:
    gpu: GpuInfo
    util_avg: float | None  # None: utilization unsupported
    throttling: str | None  # slowdown kind, None when clocks are free
    claimed_by: int | None = None  # pid of the gpuherd run holding it (0 = unknown)

    @property
    def busy(self) -> bool:
        return bool(self.gpu.foreign_processes())

    @property
    def free_gib(self) -> int:
        return (self.gpu.memory_total - self.gpu.memory_used) // 1024**3


@dataclass
class Selection:
    gpu: GpuInfo
    claim: claim.GpuClaim | None
    candidates: list[Candidate]

    def table(self) -> str:
        extra = {}
        for c in self.candidates:
            status = ("chosen" if c.gpu.index == self.gpu.index else
                      f"claimed by pid {c.claimed_by}" if c.claimed_by is not None else
                      "busy" if c.busy else f"throttling ({c.throttling})" if c.throttling else "")
            extra[c.gpu.index] = {"util avg": "n/a" if c.util_avg is None else f"{c.util_avg:.0f}%", "status": status}
        return format_device_table([c.gpu for c in self.candidates], extra=extra)


def select_least_used(
    window_s: float = 1.0,
    allowed_env: str | None = None,
    *,
    force: bool = False,
    take_claim: bool = True,
    lock_dir: Path | None = None,
    rng: random.Random | None = None,
) -> Selection:
    """Rank, claim and return the least-used allowed GPU. DeviceError: exit 2 when there
    is no GPU at all, ExitCode.BUSY_GPU when every usable GPU is busy or claimed (busy ones
    are taken only with force), exit 4 when every GPU is lost."""
    rng = rng or random.Random()
    try:
        with nvml.session() as pynvml:
            everything, handles = describe_all(pynvml)
            gpus = allowed_gpus(everything, allowed_env)
            usable = [g for g in gpus if not g.lost and not g.unusable]
            if not gpus:
                raise DeviceError("no GPU to select from" + (f" (CUDA_VISIBLE_DEVICES={allowed_env})"
                                                             if allowed_env is not None else ""), ExitCode.USAGE)
            if not usable:
                _nothing_usable(gpus)
            candidates = _measure(pynvml, {g.index: handles[g.index] for g in usable}, usable, window_s)
    except nvml.NvmlUnavailable as exc:
        raise DeviceError(f"no GPU found: {exc}", ExitCode.USAGE) from None
    ranked = sorted(candidates, key=lambda c: (
        c.busy, c.throttling is not None, round(c.util_avg or 0.0), -c.free_gib, rng.random()))
    for cand in ranked:
        if cand.busy and not force:
            break  # the rest are busy too (busy sorts last)
        if not take_claim:
            return Selection(cand.gpu, None, ranked)
        got = claim.try_claim(cand.gpu.uuid, lock_dir)
        if got is not None:
            return Selection(cand.gpu, got, ranked)
        cand.claimed_by = claim.claim_holder(cand.gpu.uuid, lock_dir) or 0
    reasons = ", ".join(
        f"GPU {c.gpu.index} " + ("claimed by another gpuherd run" if c.claimed_by is not None else "busy")
        for c in ranked)
    raise DeviceError(f"no free GPU: {reasons}; pass --force to share the least-used busy GPU",
                      ExitCode.BUSY_GPU)


def _nothing_usable(gpus: list[GpuInfo]) -> None:
    """Exit 4 when every allowed GPU is lost; exit 2 (with the reason) when some are healthy
    but not ours to use (no permission, MIG)."""
    unusable = [g for g in gpus if g.unusable]
    if not unusable:
        raise DeviceError("no usable GPU: every allowed GPU is lost (see nvidia-smi)", ExitCode.DEVICE)
    raise DeviceError(f"no usable GPU: GPU {unusable[0].index} cannot be used: {unusable[0].unusable}"
                      + (f" (and {len(gpus) - 1} more unusable or lost)" if len(gpus) > 1 else ""), ExitCode.USAGE)


def _measure(pynvml, handles: dict, gpus: list[GpuInfo], window_s: float) -> list[Candidate]:
    reader = nvml.FieldReader(pynvml)
    sums = {g.index: 0.0 for g in gpus}
    count = max(1, round(window_s / SAMPLE_EVERY))
    for n in range(count):
        for g in gpus:
            util = reader.read(g.index, "utilization", lambda h=handles[g.index]: pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            sums[g.index] = None if util == nvml.NA or sums[g.index] is None else sums[g.index] + util
        if n + 1 < count:
            time.sleep(SAMPLE_EVERY)
    out = []
    for g in gpus:
        h = handles[g.index]
        reasons = reader.read(g.index, "clock event reasons", lambda h=h: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h),
                              lambda h=h: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        total = sums[g.index]
        out.append(Candidate(g, None if total is None else total / count,
                             None if reasons == nvml.NA else nvml_meaning.slowdown_kind(reasons)))
    return out
