"""Choosing and building the engine for a strategy.

| strategy  | engine            | wrapping                                                  | grad accumulation         |
|-----------|-------------------|-----------------------------------------------------------|---------------------------|
| single    | `SingleEngine`    | none                                                      | plain                     |
| ddp       | `DDPEngine`       | DistributedDataParallel                                   | `no_sync()` until the last micro-batch |
| fsdp      | `FSDPEngine`      | FSDP2 `fully_shard` per block, then the root              | `set_requires_gradient_sync(False)` until the last, or a reduce-scatter every micro-batch (layout.py) |
| zero1     | `Zero1Engine`     | DDP + `ZeroRedundancyOptimizer` (optimizer state sharded) | `no_sync()`               |
| deepspeed | `DeepSpeedEngine` | `deepspeed.initialize` (ZeRO 1/2/3 from the JSON config)   | DeepSpeed's own boundary  |
"""

from __future__ import annotations

import torch

from gpuherd.config import Config, ConfigError
from gpuherd.memory_plan import Layout
from worker.engines.base import Buckets, Build, Engine
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


def build_engine(cfg: Config, args: ModelArgs, layout: Layout, device: torch.device,
                 attention: str, world_size: int, joining: bool = False, buckets: Buckets | None = None) -> Engine:
    """Meta-device model -> (compile) -> shard -> materialise + init -> wrap + optimizer."""
    engine_cls = ENGINES[layout.strategy]
    with torch.device("meta"):
        model = Transformer(args)
    counts = {"n_params": model.num_params(), "n_matmul_params": model.num_params(matmul_only=True)}
    model.set_attention_backend(attention)
    model.set_gradient_checkpointing(layout.checkpointing)
    if compile_enabled(cfg, device):
        # The NaN probes' forward hooks run outside the graph on purpose (debug.nan_hooks).
        compile_blocks(model, fullgraph=attention != "flash_attn" and not cfg.debug.nan_hooks)
    build = Build(cfg, device, Precision.choose(cfg, device), world_size, layout, joining, buckets)
    engine_cls.shard(model, build)
    model.to_empty(device=device)
    model.init_weights(cfg.system.seed, device)
    return engine_cls.create(model, build, counts)


def compile_enabled(cfg: Config, device: torch.device) -> bool:
    """training.compile: true / false, or unset (null) = on for CUDA, off on CPU (where
    inductor needs a C++ compiler and the first steps would take minutes)."""
    return cfg.training.compile if cfg.training.compile is not None else device.type == "cuda"


def compile_blocks(model: Transformer, fullgraph: bool) -> None:
    """Each block compiled on its own (torchtitan's recipe): one small graph reused by every
    layer instead of one huge one, and FSDP's per-block hooks stay outside the graphs.
    fullgraph=True turns any graph break into an error, so a regression cannot silently
    fall back to eager; flash-attn's kernels and the NaN probes' hooks may break the
    graph, so not with them."""
    for layer in model.layers:
        layer.compile(fullgraph=fullgraph)  # in place: parameter names stay `layers.{i}...`
