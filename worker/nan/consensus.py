"""All ranks agree on what this step is (healthy, non-finite, a spike) and learn who saw what.

Cost per step (the hot path): ONE all-reduce of FOUR elements and ONE host sync.
Why the sync cannot go: `check()` must return a Python bool before the caller
decides whether to run `optimizer.step()`; that decision is the only thing we
read back. Every test (finite loss and grad norm, loss and grad-norm spikes) is
folded into that same small tensor on the device, and the grad norm itself is the
one clipping already computed, so no extra pass over the gradients happens. The
all-reduce is what keeps ranks in lock-step: if one rank stopped, skipped or
replayed alone the others would hang in the next collective.

Bad path only: an `all_gather_object` of small per-rank records (flags, local
loss, host, device), for attribution.
"""

from __future__ import annotations

import socket
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from worker.nan.findings import RankRecord


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@dataclass(frozen=True)
class StepVerdict:
    """What every rank agreed this step is (each flag set when it holds on ANY rank)."""

    nonfinite: bool  # a non-finite loss, or gradient norm (unless fp16's scaler owns overflow)
    loss_spike: bool
    grad_norm_spike: bool
    grad_norm_finite: bool  # False also under fp16, where the step may still be healthy

    @property
    def suspicious(self) -> bool:
        return self.nonfinite or self.loss_spike or self.grad_norm_spike

    @property
    def kind(self) -> str:
        if self.nonfinite:
            return "nonfinite"
        return "loss_spike" if self.loss_spike else "grad_norm_spike"


def local_flags(nonfinite: torch.Tensor, loss_spike: torch.Tensor, grad_norm_spike: torch.Tensor,
                grad_norm_nonfinite: torch.Tensor) -> torch.Tensor:
    """This rank's four 0-d device bools as one float32 vector (the all-reduce's payload)."""
    return torch.stack([nonfinite, loss_spike, grad_norm_spike, grad_norm_nonfinite]).to(torch.float32)


def agree(local: torch.Tensor) -> StepVerdict:
    """`local`: `local_flags(...)`; left untouched (the bad path reads it for attribution)."""
    flags = local.detach().reshape(-1).clone()
    if distributed():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    nonfinite, loss_spike, norm_spike, norm_bad = flags.tolist()  # the step's one host sync: the decision
    return StepVerdict(nonfinite > 0, loss_spike > 0, norm_spike > 0, grad_norm_finite=norm_bad == 0)


def device_label(device: torch.device, bracket: str) -> str:
    return f"{device} ({bracket.strip('[]')})" if device.type == "cuda" else str(device)


def hostname() -> str:
    return socket.gethostname()


def gather_dicts(mine: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's small record (a dict with `rank`), ordered by rank (bad path only: pickles)."""
    if not distributed():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return sorted(out, key=lambda raw: raw["rank"])


def gather_records(mine: RankRecord) -> list[RankRecord]:
    return [RankRecord(**raw) for raw in gather_dicts(asdict(mine))]
