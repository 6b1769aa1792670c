"""Which data slots each process of a shrunk group trains on, and how its loss is scaled.

The sampler (dataset_cache/sampler.py) hands the W replicas of a run the W blocks of every
draw: slot r is block r of the `W * batch_size` windows, the same permutation on every rank.
When a rank is lost with no spare left (--min-replicas) the group shrinks to the survivors,
but the slots stay W: each survivor keeps its own, and each lost rank's slot `s` goes to
survivor `s mod n` (n survivors, in group order), which draws it with a second sampler at the
same position and accumulates its micro-batches before its one synchronised backward. DDP
then averages over n ranks, so every rank's loss is scaled by n / W: the gradient is the
mean over the original W replicas, and each optimizer step sees exactly the samples, in the
order, of an undisturbed run (only the all-reduce's summation order differs).
"""

from __future__ import annotations


def slots_of(rank: int, survivors: list[int], world_size: int) -> list[int]:
    """The data slots `rank` trains on in a group of `survivors` (its own first)."""
    if rank not in survivors:
        raise ValueError(f"rank {rank} is not among the survivors {survivors}")
    lost = [s for s in range(world_size) if s not in survivors]
    me = survivors.index(rank)
    return [rank, *(s for s in lost if s % len(survivors) == me)]


def loss_scale(survivors: int, world_size: int) -> float:
    """What each rank's loss is multiplied by so DDP's mean over `survivors` ranks equals the
    mean over `world_size` replicas."""
    return survivors / world_size


def draw_position(slot: int, state: dict) -> list[int]:
    """What names a draw exactly (debug.record_samples): the data slot, and its sampler's
    position after the draw (dataset_cache's BatchSampler: epoch and windows consumed in it,
    which fix the windows taken; a mixture: 0 and its position)."""
    return [slot, int(state.get("epoch", 0)), int(state.get("consumed", state.get("position", -1)))]
