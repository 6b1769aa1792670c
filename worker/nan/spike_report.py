"""The banner of a loss or gradient-norm spike, rendered from plain data (live or from a dump).

    ================================================================================
    LOSS SPIKE DETECTED [GPU 0]
    ================================================================================
    Step: 57
    Loss: 52.1234
    Gradient Norm: 3.2000
    Learning Rate: 3.00e-04
    Loss threshold: 6.8123 (median 6.5012 + 10 x 1.4826 x MAD 0.0210 over the last 100 applied steps)
    Largest gradient norms (this rank, before clipping):
      • layers.1.feed_forward.w2.weight: 12.3
    ========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.nan.banner import NARROW, WIDE, rank_records
from worker.nan.spikes import MAD_TO_SIGMA

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


def title(report: SpikeReport) -> str:
    what = "LOSS" if report.metric == "loss" else "GRADIENT NORM"
    return f"{what} SPIKE DETECTED {report.bracket}"


def render_spike(report: SpikeReport) -> list[str]:
    lines = [WIDE, title(report), WIDE, f"Step: {report.step}", f"Loss: {report.loss:.4f}",
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
    lines += _ranks(report.ranks)
    lines.append(NARROW)
    return lines


def _ranks(ranks: list[dict[str, Any]]) -> list[str]:
    records = rank_records(ranks, SpikeRecord)
    if not records:
        return []
    spiked = [r for r in records if r.loss_spike]
    if not spiked:
        return [f"No rank's own loss spiked: the gradient norm (reduced over all {len(records)} ranks) did"]
    return ([f"Ranks whose loss spiked: {[r.rank for r in spiked]} of {len(records)}"]
            + [f"  {r.describe()}" for r in spiked])
