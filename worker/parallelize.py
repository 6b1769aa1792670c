"""Strategies: how one model is built, wrapped and stepped across ranks.

torch.distributed does the work; this module only chooses and wires:

| strategy  | wrapping                                                  | grad accumulation         |
|-----------|-----------------------------------------------------------|---------------------------|
| single    | none                                                      | plain                     |
| ddp       | DistributedDataParallel                                   | `no_sync()` until the last micro-batch |
| fsdp      | FSDP2 `fully_shard` per block, then the root              | `set_requires_gradient_sync(False)` until the last |
| zero1     | DDP + `ZeroRedundancyOptimizer` (optimizer state sharded) | `no_sync()`               |
| deepspeed | `deepspeed.initialize` (ZeRO 1/2/3 from the JSON config)   | DeepSpeed's own boundary  |

Every engine exposes the same five calls the loop uses: `micro_step`,
`clip_grad_norm`, `optimizer_step`, `skip_step`, `train/eval`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from loguru import logger
from torch import nn

from gpuherd.config import Config, ConfigError
from worker.model import ModelArgs, Transformer

STRATEGIES = ("single", "ddp", "fsdp", "zero1", "deepspeed")


def resolve_strategy(requested: str, world_size: int) -> str:
    if requested == "auto":
        return "single" if world_size == 1 else "ddp"
    if requested == "ddp" and world_size == 1:
        return "single"  # DDP over one rank is pure overhead
    if requested == "single" and world_size > 1:
        raise ConfigError(f"training.strategy=single cannot train {world_size} workers (their gradients would "
                          "never meet); use ddp, fsdp, zero1 or deepspeed")
    return requested


@dataclass
class Precision:
    """What the loop runs in: autocast dtype (None = fp32) and whether a grad scaler is needed."""

    autocast_dtype: torch.dtype | None
    use_scaler: bool

    @classmethod
    def choose(cls, cfg: Config, device: torch.device) -> Precision:
        if not cfg.training.use_amp or device.type != "cuda":
            return cls(None, False)
        if cfg.training.amp_dtype == "bf16" and torch.cuda.is_bf16_supported():
            return cls(torch.bfloat16, False)
        if cfg.training.amp_dtype == "bf16":
            logger.warning("this GPU has no bf16; using fp16 autocast with a gradient scaler")
        return cls(torch.float16, True)


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (embeddings, projections), never norms: nanoGPT's split."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw_kwargs(cfg: Config, device: torch.device) -> dict[str, Any]:
    t = cfg.training
    kwargs: dict[str, Any] = {"lr": t.learning_rate, "betas": (t.beta1, t.beta2), "eps": t.eps}
    if device.type == "cuda":
        kwargs["fused"] = True  # one kernel for all parameters (build-nanogpt)
    return kwargs


@dataclass
class Engine:
    """A built, wrapped, initialised model with its optimizer, stepped the same way everywhere."""

    strategy: str
    model: nn.Module  # what forward() is called on (wrapped)
    inner: Transformer  # the unwrapped module: names, parameters, accounting
    optimizer: Any
    device: torch.device
    precision: Precision
    grad_accum: int
    scaler: torch.amp.GradScaler | None = None
    ds_engine: Any = None  # deepspeed only
    _params: list[nn.Parameter] = field(default_factory=list)
    # Counted on the meta model: ZeRO-3 partitions leave p.numel() == 0 afterwards.
    n_params: int = 0
    n_matmul_params: int = 0

    @property
    def sharded(self) -> bool:
        """Checkpoints are written per rank (DCP / DeepSpeed) rather than as one file."""
        return self.strategy in ("fsdp", "deepspeed")

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision.autocast_dtype is None or self.strategy == "fsdp":
            # FSDP casts through its MixedPrecisionPolicy instead
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast_dtype)

    # ------------------------------------------------------------------ one step
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns the detached loss."""
        if self.ds_engine is not None:
            loss = self.ds_engine(inputs, targets)
            self.ds_engine.backward(loss)  # DeepSpeed divides by its gradient_accumulation_steps
            if not is_last:
                # DeepSpeed counts micro-batches through step(); off the boundary it only
                # advances that counter. The boundary step is optimizer_step's.
                self.ds_engine.step()
            return loss.detach()
        with self._sync_context(is_last):
            with self.autocast():
                loss = self.model(inputs, targets)
            scaled = loss / self.grad_accum
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach()

    def _sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        if self.strategy == "fsdp":
            self.model.set_requires_gradient_sync(is_last)
            return contextlib.nullcontext()
        if self.strategy in ("ddp", "zero1") and not is_last:
            return self.model.no_sync()  # all-reduce once per step, on the last micro-batch
        return contextlib.nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | None:
        """Total gradient norm (a tensor, no host sync), clipping when max_norm > 0.
        DeepSpeed clips inside its step; its norm is read after the step (see after_step_norm)."""
        if self.ds_engine is not None:
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self._params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, foreach=True)
        if hasattr(total, "full_tensor"):  # FSDP: the norm of local shards is a partial DTensor
            total = total.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, max_norm, total, foreach=True)
        return total

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.ds_engine is not None:
            self.ds_engine.step()
            return
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Drop this step's gradients (NaN guard said so); keep the scaler consistent."""
        if self.scaler is not None:
            self.scaler.update()
        if self.ds_engine is None:
            self.optimizer.zero_grad(set_to_none=True)

    def after_step_norm(self) -> torch.Tensor | None:
        """DeepSpeed only: the global grad norm it computed while stepping."""
        if self.ds_engine is None:
            return None
        norm = self.ds_engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))


def build_engine(cfg: Config, args: ModelArgs, strategy: str, device: torch.device,
                 attention: str, world_size: int) -> Engine:
    """Meta-device model -> (compile) -> shard/wrap -> materialise + init -> optimizer."""
    precision = Precision.choose(cfg, device)
    t = cfg.training
    with torch.device("meta"):
        model = Transformer(args)
    counts = {"n_params": model.num_params(), "n_matmul_params": model.num_params(matmul_only=True)}
    model.set_attention_backend(attention)
    model.set_gradient_checkpointing(t.gradient_checkpointing)
    if t.compile:
        for layer in model.layers:
            layer.compile()  # in place: parameter names stay `layers.{i}...`

    if strategy == "fsdp":
        wrapped = _apply_fsdp(model, cfg, device, precision, world_size)
        model.to_empty(device=device)
        model.init_weights(cfg.system.seed, device)
    else:
        model.to_empty(device=device)
        model.init_weights(cfg.system.seed, device)
        wrapped = model

    if strategy == "deepspeed":
        return _deepspeed_engine(cfg, model, device, precision, world_size, counts)

    if strategy in ("ddp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # RoPE tables are computed identically everywhere: no per-forward buffer sync.
        # torch 2.13 renamed the switch (the old name warns on every rank's console).
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                          else {"broadcast_buffers": False})
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True, **no_buffer_sync)

    groups = optimizer_groups(model, t.weight_decay)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        kwargs = adamw_kwargs(cfg, device)
        optimizer = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                            weight_decay=t.weight_decay, **kwargs)
        optimizer.add_param_group(groups[1])
    else:
        optimizer = torch.optim.AdamW(groups, **adamw_kwargs(cfg, device))
    scaler = torch.amp.GradScaler(device.type) if precision.use_scaler else None
    return Engine(strategy, wrapped, model, optimizer, device, precision, t.grad_accum_nums,
                  scaler=scaler, _params=[p for p in model.parameters() if p.requires_grad], **counts)


def _apply_fsdp(model: Transformer, cfg: Config, device: torch.device, precision: Precision,
                world_size: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision.use_scaler:
        raise ConfigError("fp16 with training.strategy=fsdp is not supported; use bf16 or strategy ddp")
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy()
    if precision.autocast_dtype is not None:
        # compute in bf16, reduce gradients in fp32 (torchtitan's default)
        mp = MixedPrecisionPolicy(param_dtype=precision.autocast_dtype, reduce_dtype=torch.float32)
    reshard = cfg.training.fsdp_reshard_after_forward
    for i, layer in enumerate(model.layers):
        # The last block is re-gathered for backward right away: keeping it unsharded is free.
        fully_shard(layer, mesh=mesh, mp_policy=mp,
                    reshard_after_forward=reshard and i < len(model.layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    return model


# --------------------------------------------------------------------------- deepspeed


def deepspeed_config(cfg: Config, precision: Precision, world_size: int) -> dict[str, Any]:
    """The user's DeepSpeed JSON, with the fields gpuherd owns overridden.

    gpuherd drives batch sizes, LR schedule, clipping and precision from its own
    config so every strategy trains alike; DeepSpeed's `optimizer`/`scheduler`
    sections are dropped (a torch AdamW is passed in, which also avoids its
    JIT-compiled Adam kernels). A `gradient_clipping` in the file (commonly 1.0)
    is replaced by training.max_grad_norm.
    """
    t = cfg.training
    path = t.deepspeed_config
    with open(path, encoding="utf-8") as fh:
        ds = json.load(fh)
    dropped = [k for k in ("optimizer", "scheduler") if ds.pop(k, None) is not None]
    if dropped:
        logger.info(f"deepspeed config {path}: ignoring {', '.join(dropped)} (gpuherd's AdamW and LR schedule drive training)")
    if "gradient_clipping" in ds and ds["gradient_clipping"] != t.max_grad_norm:
        logger.info(f"deepspeed config gradient_clipping={ds['gradient_clipping']} replaced by training.max_grad_norm={t.max_grad_norm}")
    ds.update({
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum_nums,
        "train_batch_size": t.batch_size * t.grad_accum_nums * world_size,
        "gradient_clipping": t.max_grad_norm,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,  # gpuherd prints its own step lines
        "wall_clock_breakdown": False,
    })
    ds["bf16"] = {"enabled": precision.autocast_dtype == torch.bfloat16}
    ds["fp16"] = {"enabled": precision.autocast_dtype == torch.float16}
    return ds


def _deepspeed_engine(cfg: Config, model: Transformer, device: torch.device, precision: Precision,
                      world_size: int, counts: dict[str, int]) -> Engine:
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported
    try:
        import deepspeed
    except ImportError:
        raise ConfigError("training.strategy=deepspeed needs the deepspeed package (pip install deepspeed)") from None
    if device.type == "cpu":
        import deepspeed.ops

        # On CPU DeepSpeed would probe for a C++ compiler and JIT-build a shared-memory
        # all-reduce kernel (minutes, and fails without g++); gloo does that job already.
        # DeepSpeed reads this dict with .get(name, False), so empty = no JIT ops at all.
        deepspeed.ops.__compatible_ops__ = {}
    # DeepSpeed calls torch collectives that torch has renamed; the FutureWarning would
    # print on every step of every rank.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    ds_cfg = deepspeed_config(cfg, precision, world_size)
    optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.training.weight_decay), **adamw_kwargs(cfg, device))
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg,
                                                      dist_init_required=False)
    return Engine("deepspeed", engine, model, ds_optimizer, device, precision, cfg.training.grad_accum_nums,
                  ds_engine=engine, _params=list(model.parameters()), **counts)
