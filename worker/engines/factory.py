"""Choosing and building the engine for a strategy.

| strategy  | engine            | wrapping                                                  | grad accumulation         |
|-----------|-------------------|-----------------------------------------------------------|---------------------------|
| single    | `SingleEngine`    | none                                                      | plain                     |
| ddp       | `DDPEngine`       | DistributedDataParallel                                   | `no_sync()` until the last micro-batch |
| fsdp      | `FSDPEngine`      | FSDP2 `fully_shard` per block, then the root              | `set_requires_gradient_sync(False)` until the last |
| zero1     | `Zero1Engine`     | DDP + `ZeroRedundancyOptimizer` (optimizer state sharded) | `no_sync()`               |
| deepspeed | `DeepSpeedEngine` | `deepspeed.initialize` (ZeRO 1/2/3 from the JSON config)   | DeepSpeed's own boundary  |
"""

from __future__ import annotations

import torch

from gpuherd.config import Config, ConfigError
from worker.engines.base import Build, Engine
from worker.engines.ddp import DDPEngine, Zero1Engine
from worker.engines.deepspeed import DeepSpeedEngine
from worker.engines.fsdp import FSDPEngine
from worker.engines.precision import Precision
from worker.engines.torch_engine import SingleEngine
from worker.model import ModelArgs, Transformer

ENGINES: dict[str, type[Engine]] = {
    cls.strategy: cls for cls in (SingleEngine, DDPEngine, FSDPEngine, Zero1Engine, DeepSpeedEngine)
}
STRATEGIES = tuple(ENGINES)


def resolve_strategy(requested: str, world_size: int) -> str:
    if requested == "auto":
        return "single" if world_size == 1 else "ddp"
    if requested == "ddp" and world_size == 1:
        return "single"  # DDP over one rank is pure overhead
    if requested == "single" and world_size > 1:
        raise ConfigError(f"training.strategy=single cannot train {world_size} workers (their gradients would "
                          "never meet); use ddp, fsdp, zero1 or deepspeed")
    return requested


def needs_process_group(strategy: str) -> bool:
    """Whether the strategy needs torch.distributed even for a single worker."""
    return ENGINES[strategy].needs_process_group


def build_engine(cfg: Config, args: ModelArgs, strategy: str, device: torch.device,
                 attention: str, world_size: int) -> Engine:
    """Meta-device model -> (compile) -> shard -> materialise + init -> wrap + optimizer."""
    engine_cls = ENGINES[strategy]
    with torch.device("meta"):
        model = Transformer(args)
    counts = {"n_params": model.num_params(), "n_matmul_params": model.num_params(matmul_only=True)}
    model.set_attention_backend(attention)
    model.set_gradient_checkpointing(cfg.training.gradient_checkpointing)
    if cfg.training.compile:
        for layer in model.layers:
            layer.compile()  # in place: parameter names stay `layers.{i}...`
    build = Build(cfg, device, Precision.choose(cfg, device), world_size)
    engine_cls.shard(model, build)
    model.to_empty(device=device)
    model.init_weights(cfg.system.seed, device)
    return engine_cls.create(model, build, counts)
