"""Learning rate as a pure function of the step: linear warmup, then cosine decay.

A pure function (no scheduler object with hidden counters) is what makes resume
exact: the LR at step s depends on s and the config only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpuherd.config import TrainingConfig


@dataclass(frozen=True)
class WarmupCosine:
    peak_lr: float
    warmup_steps: int
    max_steps: int
    min_lr_ratio: float

    @classmethod
    def from_config(cls, t: TrainingConfig) -> WarmupCosine:
        return cls(t.learning_rate, t.warmup_steps, t.max_steps, t.min_lr_ratio)

    def __call__(self, step: int) -> float:
        """LR for the optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            # (s+1)/(w+1) as torchtitan: step 0 already trains, never with LR 0
            return self.peak_lr * (step + 1) / (self.warmup_steps + 1)
        span = max(1, self.max_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.peak_lr * self.min_lr_ratio
        return floor + 0.5 * (self.peak_lr - floor) * (1.0 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, float | int]:
        return {"peak_lr": self.peak_lr, "warmup_steps": self.warmup_steps,
                "max_steps": self.max_steps, "min_lr_ratio": self.min_lr_ratio}
