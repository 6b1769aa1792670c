"""The NaN report banner, rendered from plain data (live or from a dump file).

    ================================================================================
    NaN GRADIENT DETECTED [GPU 6]
    ================================================================================
    Step: 0
    Loss: 12.6087
    Gradient Norm: nan
    ...
    ========================================
    PROBLEMATIC TENSORS:
    ========================================
    ⚠️  Gradients with NaN (15 layers):
      • tok_embed.weight (shape: torch.Size([128256, 4096]))
        Grad values: ['NaN', 'NaN', 'NaN', 'NaN', 'NaN', ...]
        NaN count: 525336576/525336576
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from worker.nan.findings import RankRecord, TensorFinding, format_shape, format_values
from worker.nan.spikes import MAD_TO_SIGMA

WIDE = "=" * 80
NARROW = "=" * 40
CONSOLE_BULLETS = 30  # per section on the console; the report CLI can show all
AFFECTED_SHOWN = 20


@dataclass
class NanReport:
    bracket: str  # [GPU 6] / [CPU 0]
    step: int
    loss: float  # this rank's local loss
    grad_norm: float
    lr: float | None
    gradients: list[TensorFinding]  # non-finite gradients, model order
    parameters: list[TensorFinding]  # non-finite parameter values, model order
    affected_layers: list[str]
    first_bad_module: dict[str, Any] | None = None
    first_bad_gradient: dict[str, Any] | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)  # RankRecord dicts
    sharded: bool = False
    hooks: bool = False  # debug hooks were installed (else say how to get more)


def title(report: NanReport) -> str:
    if not math.isfinite(report.loss):
        return f"{_kind(report.loss)} LOSS DETECTED {report.bracket}"
    return f"{_kind(report.grad_norm)} GRADIENT DETECTED {report.bracket}"


def _kind(value: float) -> str:
    return "Inf" if math.isinf(value) else "NaN"


def render(report: NanReport, bullets: int | None = CONSOLE_BULLETS) -> list[str]:
    """The banner as lines (the guard logs each at ERROR so every line gets the
    supervisor's `GPUn:` prefix). `bullets=None` lists every tensor."""
    lines = [WIDE, title(report), WIDE,
             f"Step: {report.step}",
             f"Loss: {report.loss:.4f}",
             f"Gradient Norm: {report.grad_norm:.4f}"]
    if report.lr is not None:
        lines.append(f"Learning Rate: {report.lr:.2e}")
    lines += ["", NARROW, "PROBLEMATIC TENSORS:", NARROW]
    if report.sharded:
        lines.append("(FSDP: this rank's local shards; counts are over the shard, shapes are global)")
    nan_grads = [f for f in report.gradients if f.nan]
    inf_grads = [f for f in report.gradients if f.inf and not f.nan]
    if nan_grads:
        lines.append(f"⚠️  Gradients with NaN ({len(nan_grads)} layers):")
        lines += _bullets(nan_grads, "Grad", bullets)
    if inf_grads:
        lines.append(f"⚠️  Gradients with Inf ({len(inf_grads)} layers):")
        lines += _bullets(inf_grads, "Grad", bullets)
    if report.parameters:
        lines.append(f"⚠️  Parameters with NaN/Inf values ({len(report.parameters)} layers):")
        lines += _bullets(report.parameters, "Param", bullets)
    if not (report.gradients or report.parameters):
        lines.append("No gradient or parameter on this rank holds a NaN/Inf"
                     " (the non-finite value is in the loss or the gradient norm only)")
    lines += ["", f"Total layers with NaN gradients: {len(nan_grads)}"]
    if inf_grads:
        lines.append(f"Total layers with Inf gradients: {len(inf_grads)}")
    if report.parameters:
        lines.append(f"Total layers with NaN/Inf parameters: {len(report.parameters)}")
    lines.append(f"Affected layers: {_short_list(report.affected_layers)}")
    lines += _first_bad(report)
    lines += _ranks(report.ranks)
    lines.append(NARROW)
    return lines


def _bullets(findings: list[TensorFinding], what: str, limit: int | None) -> list[str]:
    out: list[str] = []
    shown = findings if limit is None else findings[:limit]
    for f in shown:
        shard = f" [local shard {format_shape(f.local_shape)}]" if f.local_shape is not None else ""
        out.append(f"  • {f.name} (shape: {format_shape(f.shape)}){shard}")
        out.append(f"    {what} values: {format_values(f.first_values, f.numel)}")
        out.append(f"    NaN count: {f.nan}/{f.numel}")
        if f.inf:
            out.append(f"    Inf count: {f.inf}/{f.numel}")
    if len(shown) < len(findings):
        out.append(f"  ... and {len(findings) - len(shown)} more (all of them: python -m worker.nan.report --all FILE.pkl)")
    return out


def _short_list(names: list[str]) -> str:
    if len(names) <= AFFECTED_SHOWN:
        return repr(names)
    head = ", ".join(repr(n) for n in names[:AFFECTED_SHOWN])
    return f"[{head}, ...] ({len(names)} in all)"


def _stats(stats: dict[str, float]) -> str:
    n = int(stats["numel"]) if math.isfinite(stats["numel"]) else 0
    return (f"min {stats['min']:.4g} max {stats['max']:.4g} mean {stats['mean']:.4g} "
            f"std {stats['std']:.4g} absmax {stats['absmax']:.4g} | "
            f"NaN {int(stats['nan'])}/{n} Inf {int(stats['inf'])}/{n}")


def _first_bad(report: NanReport) -> list[str]:
    out: list[str] = []
    module = report.first_bad_module
    if module:
        out.append(f"First non-finite module (forward): {module['module']} (micro-batch {module['micro_batch']})")
        out.append(f"    input:  {_stats(module['input'])}")
        out.append(f"    output: {_stats(module['output'])}")
    grad = report.first_bad_gradient
    if grad and grad.get("module"):
        out.append(f"First module whose input gradient goes non-finite (backward, before reduce-scatter):"
                   f" {grad['module']} (micro-batch {grad['micro_batch']})")
    elif grad:
        out.append(f"First non-finite local gradient (backward, before clipping and all-reduce): {grad['parameter']}"
                   f" (micro-batch {grad['micro_batch']}; {grad['bad_gradients']} non-finite local gradient(s) this step)")
    if not report.hooks:
        out.append("(set debug.nan_hooks=true to name the first module whose output goes non-finite)")
    elif not module and not grad:
        out.append("Forward outputs and local gradients on this rank stayed finite")
    return out


def rank_records(ranks: list[dict[str, Any]], record: type) -> list[Any]:
    """Each rank's part of a multi-rank report as `record`s; none for a single rank (nothing to compare)."""
    return [record(**r) for r in ranks] if len(ranks) > 1 else []


def _ranks(ranks: list[dict[str, Any]]) -> list[str]:
    records = rank_records(ranks, RankRecord)
    if not records:
        return []
    origin = [r for r in records if r.evidence]
    flagged = [r for r in records if r.flagged]
    if origin:
        head = f"Ranks that produced the non-finite values: {[r.rank for r in origin]} of {len(records)}"
    else:
        head = (f"Ranks with non-finite gradients: {[r.rank for r in flagged]} of {len(records)}"
                " (no rank saw a non-finite loss; set debug.nan_hooks=true to find the rank"
                " whose local gradients went bad before the all-reduce)")
    out = [head]
    shown = origin or flagged
    out += [f"  {r.describe()}" for r in shown]
    received = [r.rank for r in flagged if r not in shown]
    clean = [r.rank for r in records if not r.flagged]
    if received:
        out.append(f"  ranks {received}: non-finite gradients received through the gradient reduction"
                   " (all-reduce / reduce-scatter)")
    if clean:
        out.append(f"  ranks {clean}: finite")
    return out


# ---- the spike banner
# The banner of a loss or gradient-norm spike, rendered from plain data (live or from a dump).
#
#     ================================================================================
#     LOSS SPIKE DETECTED [GPU 0]
#     ================================================================================
#     Step: 57
#     Loss: 52.1234
#     Gradient Norm: 3.2000
#     Learning Rate: 3.00e-04
#     Loss threshold: 6.8123 (median 6.5012 + 10 x 1.4826 x MAD 0.0210 over the last 100 applied steps)
#     Largest gradient norms (this rank, before clipping):
#       • layers.1.feed_forward.w2.weight: 12.3
#     ========================================
LARGEST_SHOWN = 5


@dataclass
class SpikeRecord:
    """One rank's view of a spike (gathered on the bad path)."""

    rank: int
    bracket: str
    host: str
    device: str
    loss: float  # this rank's local loss
    grad_norm: float  # global (after the gradient reduction)
    loss_spike: bool  # this rank's loss crossed its threshold
    grad_norm_spike: bool

    def describe(self) -> str:
        what = f"loss {self.loss:.4f}" + (" (spike)" if self.loss_spike else "")
        return f"rank {self.rank} {self.bracket} {self.device} on {self.host}: {what}"


@dataclass
class SpikeReport:
    bracket: str
    step: int
    metric: str  # loss | grad_norm: what crossed its threshold (loss first when both did)
    loss: float
    grad_norm: float
    lr: float | None
    thresholds: dict[str, dict[str, Any] | None]  # metric -> ThresholdState fields, None: not judged
    largest_gradients: list[tuple[str, float]] = field(default_factory=list)  # (name, norm), largest first
    ranks: list[dict[str, Any]] = field(default_factory=list)  # SpikeRecord dicts

    @property
    def value(self) -> float:
        return self.loss if self.metric == "loss" else self.grad_norm

    @property
    def threshold(self) -> float | None:
        state = self.thresholds.get(self.metric)
        return None if state is None else state["threshold"]


def spike_title(report: SpikeReport) -> str:
    what = "LOSS" if report.metric == "loss" else "GRADIENT NORM"
    return f"{what} SPIKE DETECTED {report.bracket}"


def render_spike(report: SpikeReport) -> list[str]:
    lines = [WIDE, spike_title(report), WIDE, f"Step: {report.step}", f"Loss: {report.loss:.4f}",
             f"Gradient Norm: {report.grad_norm:.4f}"]
    if report.lr is not None:
        lines.append(f"Learning Rate: {report.lr:.2e}")
    for metric, label in (("loss", "Loss"), ("grad_norm", "Gradient-norm")):
        state = report.thresholds.get(metric)
        if state is not None:
            lines.append(f"{label} threshold: {state['threshold']:.4f} (median {state['median']:.4f} + "
                         f"{state['k']:g} x {MAD_TO_SIGMA} x MAD {state['mad']:.4f} over the last "
                         f"{min(state['seen'], state['window'])} applied steps)")
    if report.largest_gradients:
        lines.append("Largest gradient norms (this rank, before clipping):")
        lines += [f"  • {name}: {norm:.4g}" for name, norm in report.largest_gradients[:LARGEST_SHOWN]]
    lines += _spike_ranks(report.ranks)
    lines.append(NARROW)
    return lines


def _spike_ranks(ranks: list[dict[str, Any]]) -> list[str]:
    records = rank_records(ranks, SpikeRecord)
    if not records:
        return []
    spiked = [r for r in records if r.loss_spike]
    if not spiked:
        return [f"No rank's own loss spiked: the gradient norm (reduced over all {len(records)} ranks) did"]
    return ([f"Ranks whose loss spiked: {[r.rank for r in spiked]} of {len(records)}"]
            + [f"  {r.describe()}" for r in spiked])
