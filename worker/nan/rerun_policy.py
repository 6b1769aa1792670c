"""Policy `rerun`: replay a suspicious step in place and compare, to tell a flaky device
from a bad batch (Megatron-LM's `--rerun-mode validate_results`, reduced to one step).

- transient: the replay differs from the first run AND is healthy. Something broke
  once and did not come back: the device is suspected (silent data corruption). The
  replay's gradients are what the step should have produced, so they are applied and
  training goes on; the device is counted and named.
- reproducible: the replay gives the same values bit for bit, or is suspicious again
  (kernels that are not deterministic may move the last bits, not a NaN or a spike):
  the batch or the model is at fault. The batch is named and the run stops (exit 9).

What is kept per step, only while a rerun policy is on: the RNG states before the
step's first forward (host copies; CUDA generator states live on the host, so no
sync) and the batch tensors the loop holds anyway. No copy of the model: the step is
judged before `optimizer.step()`, so weights and optimizer state are still exactly
what the step started from; only the gradients are computed again.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KeptStep:
    """Taken before the step draws its batches."""

    source: Any  # the loop's batch source (for naming the samples)
    position: dict[str, Any] | None  # its state_dict() before this step's batches
    rng: dict[str, Any] | None  # gpuherd.rng.capture(), only with a rerun policy


@dataclass
class RerunRecord:
    """One rank's first run and replay of the step (gathered from every rank)."""

    rank: int
    bracket: str
    host: str
    device: str
    loss: float  # first run, this rank's local loss
    grad_norm: float  # first run, global
    replay_loss: float
    replay_grad_norm: float
    evidence: bool  # the first run's bad value started on this rank (local loss, debug probes)

    @property
    def loss_changed(self) -> bool:
        return not same_bits(self.loss, self.replay_loss)

    @property
    def identical(self) -> bool:
        return not self.loss_changed and same_bits(self.grad_norm, self.replay_grad_norm)

    def describe(self) -> str:
        return f"rank {self.rank} {self.bracket} {self.device} on {self.host}"


@dataclass
class Classification:
    transient: bool
    identical: bool  # every rank's replay matched its first run bit for bit
    culprits: list[int]  # ranks blamed for a transient fault; empty: could not tell
    records: list[RerunRecord]

    @property
    def label(self) -> str:
        return "transient" if self.transient else "reproducible"

    def culprit_records(self) -> list[RerunRecord]:
        return [r for r in self.records if r.rank in self.culprits]


def same_bits(a: float, b: float) -> bool:
    """Bit-for-bit equality of two float32 results (widened exactly to Python floats);
    any NaN equals any NaN (payload bits of a NaN carry no meaning here)."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


def classify(records: list[RerunRecord], suspicious_again: bool) -> Classification:
    """The same answer on every rank: it depends only on the gathered records and the
    replay's agreed verdict. Culprits of a transient fault: the ranks whose own loss
    changed (the fault hit their forward pass), else those holding the first run's
    evidence (their local gradients went bad before the reduction), else the only
    rank. Under data parallelism a gradient fault is spread by the reduction, so
    without `debug.nan_hooks` the rank may stay unknown."""
    identical = all(r.identical for r in records)
    transient = not identical and not suspicious_again
    culprits: list[int] = []
    if transient:
        culprits = ([r.rank for r in records if r.loss_changed] or [r.rank for r in records if r.evidence]
                    or ([records[0].rank] if len(records) == 1 else []))
    return Classification(transient, identical, culprits, records)


class FaultLedger:
    """Transient faults per rank, kept alike on every rank (fed the gathered outcome),
    so that all ranks decide together when one device has had too many."""

    def __init__(self) -> None:
        self.counts: dict[int | None, int] = {}  # None: faults whose rank could not be told

    def add(self, culprits: list[int]) -> None:
        for rank in culprits or [None]:
            self.counts[rank] = self.counts.get(rank, 0) + 1

    def over(self, limit: int) -> list[int | None]:
        return [rank for rank, count in self.counts.items() if count > limit]


def clear_gradients(model: torch.nn.Module, scaler: Any) -> None:
    """Start the replay from no gradients, as the step itself did."""
    model.zero_grad(set_to_none=True)
    if scaler is not None:
        # Clipping already unscaled this step's gradients, and GradScaler refuses a second
        # unscale_() before update(). Forgetting only that per-optimizer stage (the scale
        # itself stays) lets the replay unscale its own gradients with the same scale.
        scaler._per_optimizer_states.clear()


def deterministic_kernels() -> tuple[bool, bool]:
    """Bit-for-bit replays need kernels without run-to-run variation. warn_only: an op
    without a deterministic version warns (once) instead of failing the run; the
    classification then leans on "suspicious again" rather than on equal bits.
    Returns the previous setting, for `restore_kernels` (the setting is process-wide)."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    return before


def restore_kernels(before: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
