"""DDP's gradient buckets carried from a wrapper to the one that replaces it over a rebuilt group.

Shared by the built-in trainer's DDP engine (worker/engines/ddp.py) and a script's live recovery
(gpuherd/live.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

Buckets = tuple[tuple[int, ...], ...]  # parameter indices per bucket, in reduction order


def gradient_buckets(wrapper: nn.Module) -> Buckets | None:
    """The parameter indices of each gradient bucket, in reduction order, as DDP rebuilt them
    after its first step (from the order gradients became ready); None before that rebuild.

    A rebuilt process group needs a new wrapper, and a new wrapper starts from DDP's initial
    buckets (parameters in reverse definition order). With more than two ranks the all-reduce
    adds each element's values in an order that depends on where the element sits in its
    bucket, so starting from other buckets than the wrapper it replaces changes the sums in
    their last bits: the run would no longer equal an uninterrupted one."""
    text = wrapper._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not isinstance(text, str) or not text.strip():
        return None
    return tuple(tuple(int(i) for i in bucket.split()) for bucket in text.split(","))


@contextlib.contextmanager
def starting_buckets(buckets: Buckets | None):
    """DDP computes its initial buckets inside its constructor, with no argument to give them:
    while it runs, that computation answers `buckets` (checked to hold each parameter once)."""
    if buckets is None:
        yield
        return
    assign = dist._compute_bucket_assignment_by_size

    def given(tensors: list[torch.Tensor], limits: list[int], *args: Any, **kwargs: Any) -> Any:
        if sorted(i for bucket in buckets for i in bucket) != list(range(len(tensors))):
            return assign(tensors, limits, *args, **kwargs)  # another model: DDP's own buckets
        ordered = [list(bucket) for bucket in reversed(buckets)]  # DDP reverses what this returns
        return ordered, [limits[-1]] * len(ordered)

    dist._compute_bucket_assignment_by_size = given
    try:
        yield
    finally:
        dist._compute_bucket_assignment_by_size = assign
