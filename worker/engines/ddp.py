"""DistributedDataParallel, and ZeRO-1 (DDP plus a `ZeroRedundancyOptimizer` that
shards the optimizer state): gradients are all-reduced once per step, on the
last micro-batch (`no_sync()` before it)."""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from gpuherd.ddp_buckets import gradient_buckets, starting_buckets
from worker.engines.base import Buckets, Build
from worker.engines.precision import adamw_kwargs, optimizer_groups
from worker.engines.torch_engine import TorchEngine
from worker.model import Transformer


@dataclass
class DDPEngine(TorchEngine):
    strategy: ClassVar[str] = "ddp"
    live_recoverable: ClassVar[bool] = True

    @classmethod
    def wrap(cls, model: Transformer, build: Build) -> nn.Module:
        return _ddp(model, build.device, init_sync=not build.joining, buckets=build.buckets)

    def drop_group(self) -> None:
        old, self.model = self.model, self.inner
        self.buckets = gradient_buckets(old)  # the rebuilt group's wrappers reduce in this order too
        # The reducer's autograd hooks would all-reduce on the dead group, and it, its logger and the
        # wrapper hold the group: cut all three (others may still hold the old wrapper, e.g. the
        # NaN guard's probes, for its modules only).
        for attr in ("reducer", "logger", "process_group"):
            if hasattr(old, attr):
                delattr(old, attr)
        self.optimizer.zero_grad(set_to_none=True)  # grads were views into the old reducer's buckets

    def regroup(self, buckets: Buckets | None) -> None:
        self.model = _ddp(self.inner, self.device, init_sync=False, buckets=buckets)

    def sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if is_last else self.model.no_sync()


def _ddp(model: nn.Module, device: torch.device, init_sync: bool, buckets: Buckets | None = None) -> nn.Module:
    """`init_sync=False`: no shape check or rank-0 broadcast at construction (a rebuilt group,
    whose state a survivor broadcasts right after); `buckets`: the gradient buckets to start
    with (`gradient_buckets` of the wrapper it replaces)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    params = inspect.signature(DDP.__init__).parameters
    # RoPE tables are computed identically everywhere: no per-forward buffer sync.
    # torch 2.13 renamed the switch (the old name warns on every rank's console).
    kwargs: dict[str, Any] = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params
                              else {"broadcast_buffers": False})
    if not init_sync and "init_sync" in params:
        kwargs["init_sync"] = False
    with starting_buckets(buckets):
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                   gradient_as_bucket_view=True, **kwargs)


@dataclass
class Zero1Engine(DDPEngine):
    strategy: ClassVar[str] = "zero1"
    live_recoverable: ClassVar[bool] = False  # each rank's optimizer shard exists nowhere else
    optimizer_format: ClassVar[str] = "zero1"  # optimizer state keyed by parameter index

    @classmethod
    def make_optimizer(cls, model: Transformer, build: Build) -> Any:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        decay = build.cfg.training.weight_decay
        groups = optimizer_groups(model, decay)
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            weight_decay=decay, **adamw_kwargs(build.cfg, build.device))
        optimizer.add_param_group(groups[1])
        return optimizer

    def full_optimizer_state(self, rank: int, to_host: bool = True) -> dict[str, Any] | None:
        self.optimizer.consolidate_state_dict(to=0)  # collective
        return self.optimizer.state_dict() if rank == 0 else None

    def load_full_states(self, ckpt: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.inner, ckpt["model"], options=StateDictOptions(full_state_dict=True))
        self.optimizer.load_state_dict(ckpt["optimizer"])
