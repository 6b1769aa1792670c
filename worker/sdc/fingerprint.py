"""A replica's state reduced to a few integers: per bucket, the wrapping 64-bit sum of its raw bits.

A bucket is one tensor (a parameter, or one optimizer state entry of a parameter). Its bytes
are read as 64-bit words (two float32 values, four bf16 values per word) and summed with
wrap-around, i.e. modulo 2**64. Integer addition is exact and its order does not matter, so
every rank gets the same number for the same bits whatever its kernels' reduction order,
and it runs at memory speed (one read of the tensor: about 13 ms for 75M float32 values on
one CPU core).

What it catches: any single flipped bit, always — it changes one word by +-2**k with k < 64,
and so the sum by +-2**k, which is never 0 modulo 2**64; any number of wrong values unless
their changes cancel exactly modulo 2**64, as unlikely as a 64-bit hash collision for the
values a faulty unit produces. The difference of two ranks' sums even says which bit: a
single flip leaves exactly +-2**k. What it cannot see (a hash would): values that trade
places inside one bucket, a permutation, which arithmetic faults do not produce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

WORD_BYTES = 8
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def word_sum(t: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of `t`'s raw bits (a 0-d tensor on t's device, no host sync)."""
    flat = local(t).detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    size = flat.element_size()
    aligned = (flat.storage_offset() * size) % WORD_BYTES == 0 and (flat.numel() * size) % WORD_BYTES == 0
    if aligned and size <= WORD_BYTES:  # the fast path: whole 64-bit words
        return flat.view(torch.int64).sum()
    # an odd length or offset: each value widened on its own (exact, slower; every rank takes
    # the same path, which depends on shape and offset only)
    return flat.view(_SAME_SIZE_INT[size]).to(torch.int64).sum()


@dataclass
class Fingerprint:
    """Bucket names (the same on every replica) and their sums, stacked in one int64 tensor."""

    names: list[str]
    sums: torch.Tensor

    @classmethod
    def of(cls, named: list[tuple[str, torch.Tensor]], device: torch.device) -> Fingerprint:
        if not named:
            return cls([], torch.zeros(0, dtype=torch.int64, device=device))
        return cls([n for n, _ in named], torch.stack([word_sum(t).to(device) for _, t in named]))


def parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, p) for name, p in model.named_parameters()]


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the optimizer state (AdamW: exp_avg, exp_avg_sq, step), named by its parameter."""
    out = []
    for name, p in model.named_parameters():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out.append((f"{name}:{key}", value))
    return out
