"""All ranks agree on "this step is non-finite" and learn who saw what.

Cost per step (the hot path): ONE all-reduce of ONE element and ONE host sync.
Why the sync cannot go: `check()` must return a Python bool before the caller
decides whether to run `optimizer.step()`; that decision is the only thing we
read back. Everything else (finite tests of loss and grad norm) is folded into
that same element on the device, and the grad norm itself is the one clipping
already computed, so no extra pass over the gradients happens. The all-reduce
is what keeps ranks in lock-step: if one rank stopped or skipped alone the
others would hang in the next collective.

Bad path only: an `all_gather_object` of small per-rank records (flags, local
loss, host, device), for attribution.
"""

from __future__ import annotations

import socket
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from worker.nan.ranks import RankRecord


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def any_rank_bad(local_bad: torch.Tensor) -> bool:
    """`local_bad`: 0-d tensor on the loss's device (nonzero = non-finite here)."""
    flag = local_bad.detach().reshape(1).to(torch.float32)
    if distributed():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())  # the step's one host sync: the decision itself


def device_label(device: torch.device, bracket: str) -> str:
    return f"{device} ({bracket.strip('[]')})" if device.type == "cuda" else str(device)


def hostname() -> str:
    return socket.gethostname()


def gather_records(mine: RankRecord) -> list[RankRecord]:
    """Every rank's record, ordered by rank (bad path only: pickles objects)."""
    if not distributed():
        return [mine]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, asdict(mine))
    return sorted((RankRecord(**raw) for raw in out), key=lambda r: r.rank)
