"""Loss and gradient-norm spikes, judged on the device against a robust running threshold.

    threshold = median + spike_k x 1.4826 x MAD     over the last `spike_window` applied steps

Median and MAD (median absolute deviation) ignore the few wild values a mean and a
standard deviation would chase, so one spike does not raise the bar for the next.
Only values above the threshold count: a loss that falls faster than usual is
training going well. Nothing is judged before `spike_warmup` applied steps were
seen, and only applied (healthy or retried) steps enter the history.

Everything stays on the device: the comparison is a device tensor that the guard
folds into the step's one all-reduce, so a healthy step costs no host sync here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpuherd.config import DebugConfig

MAD_TO_SIGMA = 1.4826  # for normally distributed values 1.4826 x MAD estimates the standard deviation
# A history with no spread at all (MAD 0: a constant value, e.g. a clipped or saturated
# metric) would flag any increase; the spread is taken as at least 1% of the median.
MIN_RELATIVE_SPREAD = 0.01


@dataclass
class ThresholdState:
    """A running threshold read back on the host (bad path only, for reports and dumps)."""

    median: float
    mad: float
    threshold: float
    seen: int  # applied steps observed so far
    window: int
    k: float


class RunningThreshold:
    """One metric's history in a device ring buffer and the threshold derived from it."""

    def __init__(self, window: int, warmup: int, k: float) -> None:
        self.window, self.warmup, self.k = window, warmup, k
        self.seen = 0  # host counter: which slot to write, and whether to judge yet
        self._history: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None  # [median, mad, threshold] on the device

    @property
    def judging(self) -> bool:
        return self._stats is not None and self.seen >= max(self.warmup, 1)

    def exceeds(self, value: torch.Tensor) -> torch.Tensor:
        """0-d bool on `value`'s device: above the threshold (False while warming up, and for NaN)."""
        if not self.judging:
            return torch.zeros((), dtype=torch.bool, device=value.device)
        return value > self._stats[2].to(value.device)

    def observe(self, value: torch.Tensor) -> None:
        """Add an applied step's value; device ops only (the slot index is a host int)."""
        value = value.detach().reshape(()).to(torch.float32)
        if self._history is None or self._history.device != value.device:
            self._history = torch.zeros(self.window, dtype=torch.float32, device=value.device)
        self._history[self.seen % self.window] = value
        self.seen += 1
        recent = self._history[:min(self.seen, self.window)]
        median = recent.median()
        mad = (recent - median).abs().median()
        spread = torch.maximum(MAD_TO_SIGMA * mad, MIN_RELATIVE_SPREAD * median.abs())
        self._stats = torch.stack([median, mad, median + self.k * spread])

    def read(self) -> ThresholdState | None:
        """The current threshold on the host (one sync: call on the bad path only)."""
        if self._stats is None:
            return None
        median, mad, threshold = self._stats.cpu().tolist()
        return ThresholdState(median, mad, threshold, self.seen, self.window, self.k)


class SpikeDetector:
    """The loss's threshold and, unless `debug.spike_grad_norm=false`, the gradient norm's."""

    def __init__(self, window: int, warmup: int, k: float, grad_norm: bool) -> None:
        self.loss = RunningThreshold(window, warmup, k)
        self.grad_norm = RunningThreshold(window, warmup, k) if grad_norm else None

    @classmethod
    def from_config(cls, d: DebugConfig) -> SpikeDetector | None:
        if d.spike_policy == "off":
            return None
        return cls(d.spike_window, d.spike_warmup, d.spike_k, d.spike_grad_norm)

    def flags(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss spike, grad-norm spike) as 0-d device bools."""
        norm_flag = (self.grad_norm.exceeds(grad_norm) if self.grad_norm is not None
                     else torch.zeros((), dtype=torch.bool, device=grad_norm.device))
        return self.loss.exceeds(loss), norm_flag

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """`grad_norm=None`: a step applied with a non-finite norm (fp16's GradScaler skips
        those itself): such a value would poison the median, so it is left out."""
        self.loss.observe(loss)
        if self.grad_norm is not None and grad_norm is not None:
            self.grad_norm.observe(grad_norm)

    def read(self) -> dict[str, ThresholdState | None]:
        return {"loss": self.loss.read(), "grad_norm": self.grad_norm.read() if self.grad_norm else None}
