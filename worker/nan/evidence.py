"""What a suspicious step showed, gathered from every rank and shaped for the three
places it goes: the banner (console), the debug pickle and the status record.

Two kinds: non-finite values (the NaN banner and tensors) and spikes (the
threshold that was crossed, the largest gradient norms). Bad path only: these read
tensors back to the host and gather small records from every rank, collectively.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from loguru import logger

from gpuherd.contract import WorkerIdentity
from worker.nan import dump
from worker.nan.banner import NanReport, SpikeRecord, SpikeReport, render, render_spike
from worker.nan.consensus import StepVerdict, device_label, gather_dicts, gather_records, hostname
from worker.nan.findings import RankRecord
from worker.nan.inspect_model import ModelInspection, inspect_model
from worker.nan.names import local_tensor, named_parameters
from worker.nan.probes import ForwardProbe, GradProbe
from worker.nan.spikes import SpikeDetector

LARGEST_KEPT = 20  # per-parameter gradient norms kept in a spike's dump


@dataclass
class Evidence:
    record_type: str  # status record type: nan | spike
    kind: str  # nonfinite | loss_spike | grad_norm_spike
    banner: list[str]  # printed by the reporting ranks
    origin: list[int]  # ranks where the bad value started
    reporters: list[int]  # ranks that print the banner
    dumpers: list[int]  # ranks that write a debug pickle
    device: str  # this rank's device, as the banner names it
    dump_entries: Callable[[], dict[str, Any]]  # kind-specific pickle entries (called by dumpers only)
    fields: dict[str, Any]  # kind-specific status-record fields


def number_or_text(value: float) -> float | str:
    """orjson would write NaN/Inf as null; the record keeps them readable."""
    return value if math.isfinite(value) else str(value)


def nonfinite_evidence(model: torch.nn.Module, identity: WorkerIdentity, probes: tuple[ForwardProbe | None, GradProbe | None],
                       step: int, loss: float, grad_norm: float, lr: float, max_dump_mb: int) -> Evidence:
    inspection = inspect_model(model)
    forward, grads = probes
    first_module = forward.first_bad() if forward else None
    first_grad = grads.first_bad() if grads else None
    device = device_label(_device(model), identity.bracket)
    mine = RankRecord(
        rank=identity.rank, tag=identity.tag, bracket=identity.bracket, host=hostname(), device=device,
        loss=loss, grad_norm=grad_norm, loss_bad=not math.isfinite(loss),
        grad_norm_bad=not math.isfinite(grad_norm), bad_parameters=len(inspection.bad_parameters),
        bad_gradients=len(inspection.bad_gradients),
        first_bad_module=first_module["module"] if first_module else None,
        first_bad_gradient=(first_grad.get("parameter") or first_grad.get("module")) if first_grad else None,
        sharded=inspection.sharded,
    )
    records = gather_records(mine)
    reporters = _reporters(records)
    report = NanReport(
        bracket=identity.bracket, step=step, loss=loss, grad_norm=grad_norm, lr=lr,
        gradients=inspection.bad_gradients, parameters=inspection.bad_parameters,
        affected_layers=inspection.affected_layers, first_bad_module=first_module,
        first_bad_gradient=first_grad, ranks=[asdict(r) for r in records],
        sharded=inspection.sharded, hooks=forward is not None,
    )
    origin = [r.rank for r in records if r.evidence] or [r.rank for r in records if r.flagged]
    return Evidence(
        record_type="nan", kind="nonfinite", banner=render(report), origin=origin, reporters=reporters,
        # Under sharding every flagged rank holds a different piece of the state: all of them dump.
        dumpers=sorted(set(reporters) | {r.rank for r in records if r.flagged and r.sharded}),
        device=device, dump_entries=lambda: _nonfinite_entries(model, identity, inspection, report, max_dump_mb),
        fields={"loss": number_or_text(loss), "grad_norm": number_or_text(grad_norm)},
    )


def _nonfinite_entries(model: torch.nn.Module, identity: WorkerIdentity, inspection: ModelInspection,
                       report: NanReport, max_dump_mb: int) -> dict[str, Any]:
    """The pickle entries of a non-finite step; called by the dumping ranks only, since
    selecting the tensors reads them back to the host."""
    selection = dump.select_tensors(model, inspection.affected_layers, max_dump_mb * 2**20)
    notes = []
    if inspection.sharded:
        notes.append(f"FSDP: rank {identity.rank} dumped its local shards; arrays have local shard shapes,"
                     " 'shapes' holds the global ones; load every rank's file for whole tensors")
    if selection.empty_shards:
        notes.append(f"no local elements (empty shards, not dumped): {selection.empty_shards}")
    omitted = dump.omitted_note(selection, max_dump_mb)
    if omitted:
        notes.append(omitted)
        logger.warning(f"{identity.bracket} {omitted}")
    return {
        "parameters": selection.parameters, "gradients": selection.gradients,
        "affected_layers": report.affected_layers, "first_bad_module": report.first_bad_module,
        "first_bad_gradient": report.first_bad_gradient, "ranks": report.ranks, "sharded": inspection.sharded,
        "shapes": {f.name: f.shape for f in inspection.parameters}, "omitted": selection.omitted,
        "max_dump_mb": max_dump_mb, "notes": notes, "report": asdict(report),
    }


def _reporters(records: list[RankRecord]) -> list[int]:
    """Ranks that print the banner and write a dump: those that produced the
    bad values; failing that (all ranks only received NaN gradients through
    the all-reduce, or the norm overflowed) one rank under replication, every
    flagged rank under sharding (each holds different shards)."""
    origin = [r.rank for r in records if r.evidence]
    if origin:
        return origin
    flagged = [r for r in records if r.flagged] or records
    if any(r.sharded for r in flagged):
        return [r.rank for r in flagged]
    return [flagged[0].rank]


def spike_evidence(model: torch.nn.Module, identity: WorkerIdentity, detector: SpikeDetector, verdict: StepVerdict,
                   local: list[float], step: int, loss: float, grad_norm: float, lr: float) -> Evidence:
    """`local`: this rank's own flags [non-finite, loss spike, grad-norm spike, norm non-finite]."""
    device = device_label(_device(model), identity.bracket)
    mine = SpikeRecord(rank=identity.rank, bracket=identity.bracket, host=hostname(), device=device, loss=loss,
                       grad_norm=grad_norm, loss_spike=local[1] > 0, grad_norm_spike=local[2] > 0)
    records = [SpikeRecord(**raw) for raw in gather_dicts(asdict(mine))]
    thresholds = {metric: (asdict(state) if state is not None else None) for metric, state in detector.read().items()}
    report = SpikeReport(bracket=identity.bracket, step=step, metric="loss" if verdict.loss_spike else "grad_norm",
                         loss=loss, grad_norm=grad_norm, lr=lr, thresholds=thresholds,
                         largest_gradients=largest_gradient_norms(model), ranks=[asdict(r) for r in records])
    # A loss is local: the ranks whose own loss spiked hold the batch that did it. The
    # gradient norm is reduced over all ranks: then one rank speaks for all.
    origin = [r.rank for r in records if r.loss_spike] or [records[0].rank]
    return Evidence(
        record_type="spike", kind=verdict.kind, banner=render_spike(report), origin=origin, reporters=origin,
        dumpers=origin, device=device,
        dump_entries=lambda: {"parameters": {}, "gradients": {}, "spike": asdict(report),
                              "gradient_norms": dict(report.largest_gradients), "notes": []},
        fields={"metric": report.metric, "loss": number_or_text(loss), "grad_norm": number_or_text(grad_norm),
                "threshold": report.threshold},
    )


def largest_gradient_norms(model: torch.nn.Module) -> list[tuple[str, float]]:
    """Per-parameter gradient norms (this rank's shards under FSDP), largest first; one sync."""
    named = [(name, local_tensor(p.grad.detach())) for name, p in named_parameters(model) if p.grad is not None]
    named = [(name, g) for name, g in named if g.numel()]
    if not named:
        return []
    norms = torch.stack([g.float().norm() for _, g in named]).cpu().tolist()
    ranked = sorted(zip((n for n, _ in named), norms, strict=True), key=lambda item: -item[1])
    return [(name, float(norm)) for name, norm in ranked[:LARGEST_KEPT]]


def _device(model: torch.nn.Module) -> torch.device:
    return next((local_tensor(p).device for p in model.parameters()), torch.device("cpu"))
