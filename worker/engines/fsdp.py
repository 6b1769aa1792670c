"""FSDP2: `fully_shard` per block, then the root; checkpoints as DCP shards per rank; live
recovery over a rebuilt process group from the buddy copies of each shard (worker/shard_copies.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from gpuherd.config import ConfigError
from worker.checkpoint_io import FORMAT_DCP, publish_dir
from worker.engines.base import Buckets, Build, Engine
from worker.engines.torch_engine import TorchEngine
from worker.model import Transformer


@dataclass
class FSDPEngine(TorchEngine):
    strategy: ClassVar[str] = "fsdp"
    sharded: ClassVar[bool] = True
    live_recoverable: ClassVar[bool] = True
    shard_copies: ClassVar[bool] = True

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

    def local_state(self) -> list[torch.Tensor]:
        """This rank's shard, live: every parameter's local piece, then each one's optimizer state
        (its keys sorted), in the model's parameter order, the same on every rank. An optimizer
        that has not stepped yet (a newcomer's) gets its state first, zeros, to be overwritten."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        _init_optim_state(self.optimizer)
        params = list(self.inner.parameters())
        state = [value for p in params for _, value in sorted(self.optimizer.state[p].items())]
        with torch.no_grad():  # the pieces are views of the shards, written in place by a recovery
            return [t.to_local() if hasattr(t, "to_local") else t for t in (*params, *state)]

    def drop_group(self) -> None:
        # FSDP's modules keep their groups until regroup() points them at the rebuilt one; the broken
        # group's connections are shut down by the caller (gpuherd/broken_group.py: sever_peer_connections)
        self.optimizer.zero_grad(set_to_none=True)

    def regroup(self, buckets: Buckets | None) -> None:
        """The rebuilt default group (same world size, each rank at its place) for every FSDP
        module: the device mesh resolves its group by name, and each mesh description keeps the
        group object it was built with. Sharding, parameters and optimizer state stay as they are."""
        import torch.distributed as dist
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

        # a step cut short may have left blocks unsharded (their full parameters registered in place of
        # the shards) and collectives pending: back to the sharded, idle state first
        self.inner.reset_iter_state()
        self._drop_unsharded_grads()
        group = dist.distributed_c10d._get_default_group()
        meshes = {}
        for module in self.inner.modules():
            state = _get_module_fsdp_state(module)
            params = getattr(state, "_fsdp_param_group", None) if state is not None else None
            if params is None:
                continue
            for info in (params.mesh_info, params.post_forward_mesh_info,
                         *(p.mesh_info for p in params.fsdp_params), *(p.post_forward_mesh_info for p in params.fsdp_params)):
                if info is not None and hasattr(info, "shard_process_group"):
                    info.shard_process_group = group
                    info.reduce_scatter_process_group = None
                    meshes[id(info.mesh)] = info.mesh
        for mesh in meshes.values():
            mesh._dim_group_names = [group.group_name]
            mesh._pg_registry = {group.group_name: group}

    def _drop_unsharded_grads(self) -> None:
        """A backward cut short leaves gradients on the unsharded parameters of the groups whose
        reduce-scatter had not run yet (the root's: the output layer and final norm, computed first,
        reduced last); `reset_iter_state` keeps them, and autograd would add them to the step done
        again. Gradient accumulation without a reduce per micro-batch keeps its sum there too."""
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

        for module in self.inner.modules():
            state = _get_module_fsdp_state(module)
            params = getattr(state, "_fsdp_param_group", None) if state is not None else None
            for fsdp_param in params.fsdp_params if params is not None else ():
                fsdp_param.unsharded_accumulated_grad = None
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None

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
