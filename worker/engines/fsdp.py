"""FSDP2: `fully_shard` per block, then the root; checkpoints as DCP shards per rank."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from gpuherd.config import ConfigError
from worker.checkpoint_io import FORMAT_DCP, publish_dir
from worker.engines.base import Build, Engine
from worker.engines.torch_engine import TorchEngine
from worker.model import Transformer


@dataclass
class FSDPEngine(TorchEngine):
    strategy: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True

    reduce_every_micro_batch: bool = False  # the memory plan's choice (gpuherd/memory_plan.py)

    @classmethod
    def create(cls, model: Transformer, build: Build, counts: dict[str, int]) -> Engine:
        engine = super().create(model, build, counts)
        engine.reduce_every_micro_batch = build.layout.reduce_every_micro_batch
        return engine

    @classmethod
    def shard(cls, model: Transformer, build: Build) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        precision = build.precision
        if precision.use_scaler:
            raise ConfigError("fp16 with training.strategy=fsdp is not supported; use bf16 or strategy ddp")
        mesh = init_device_mesh(build.device.type, (build.world_size,))
        mp = MixedPrecisionPolicy()
        if precision.autocast_dtype is not None:
            # Compute in bf16, reduce gradients in fp32 (torchtitan's default). Forward
            # inputs are not cast: a block's inputs include the float32 rotary tables, and
            # the residual stream is bf16 already (it starts at the bf16 embedding).
            mp = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
        reshard = build.cfg.training.fsdp_reshard_after_forward
        for i, layer in enumerate(model.layers):
            # The last block is re-gathered for backward right away: keeping it unsharded is free.
            fully_shard(layer, mesh=mesh, mp_policy=mp,
                        reshard_after_forward=reshard and i < len(model.layers) - 1)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # FSDP casts through its MixedPrecisionPolicy instead

    def sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        # Without a reduce-scatter per micro-batch every rank accumulates the whole model's
        # gradients unsharded in fp32 until the last one: fewer collectives, 4 B/param more.
        self.model.set_requires_gradient_sync(is_last or self.reduce_every_micro_batch)
        return contextlib.nullcontext()

    def total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        total = super().total_norm(grads)
        # the norm of local shards is a partial DTensor (a plain tensor when no shard has a gradient)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    def capture_states(self, rank: int, to_host: bool) -> dict[str, Any] | None:
        """This rank's shards (DTensors of the live parameters and optimizer state)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.inner, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def write_states(self, states: dict[str, Any] | None, path: Path, meta: dict[str, Any], rank: int,
                     group: Any = None) -> None:
        import torch.distributed.checkpoint as dcp

        publish_dir(path, dict(meta, format=FORMAT_DCP), rank,
                    lambda tmp: dcp.save(states, checkpoint_id=tmp, process_group=group), group)
