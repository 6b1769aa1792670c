"""DeepSpeed: `deepspeed.initialize` (ZeRO 1/2/3 from the user's JSON) with gpuherd's
AdamW, batch sizes, clipping and precision, so it trains like the other strategies.
DeepSpeed accumulates, clips and steps itself, and writes its own checkpoint directory."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from loguru import logger

from gpuherd.config import Config, ConfigError
from gpuherd.exit_codes import ExitCode
from worker.checkpoint_io import FORMAT_DEEPSPEED, publish_dir
from worker.distributed import WorkerError
from worker.engines.base import Build, Engine, StepCheck
from worker.engines.precision import Precision
from worker.model import Transformer


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


def _import_deepspeed(device: torch.device) -> Any:
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
    return deepspeed


@dataclass
class DeepSpeedEngine(Engine):
    """`model` is DeepSpeed's engine: forward, backward and step all go through it."""

    strategy: ClassVar[str] = "deepspeed"
    sharded: ClassVar[bool] = True

    @classmethod
    def create(cls, model: Transformer, build: Build, counts: dict[str, int]) -> Engine:
        deepspeed = _import_deepspeed(build.device)
        ds_cfg = deepspeed_config(build.cfg, build.precision, build.world_size)
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=cls.make_optimizer(model, build),
                                                          config=ds_cfg, dist_init_required=False)
        return cls(engine, model, ds_optimizer, build.device, build.precision, build.cfg.training.grad_accum_nums,
                   _params=list(model.parameters()), **counts)

    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool) -> torch.Tensor:
        loss = self.model(inputs, targets)
        self.model.backward(loss)  # DeepSpeed divides by its gradient_accumulation_steps
        if not is_last:
            # DeepSpeed counts micro-batches through step(); off the boundary it only
            # advances that counter. The boundary step is step()'s.
            self.model.step()
        return loss.detach()

    def step(self, lr: float, max_grad_norm: float, check: StepCheck | None) -> tuple[torch.Tensor | None, bool]:
        """DeepSpeed clips inside its step, so the norm (and the NaN check, which can
        only report here, not veto) come after it; max_grad_norm is in its config."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.step()
        norm = self.model.get_global_grad_norm()
        norm = None if norm is None else torch.as_tensor(float(norm))
        if check is not None and norm is not None:
            check(norm, None)  # after the optimizer step: nothing left to replay
        return norm, True

    # DeepSpeed's engine gathers and writes its state in one collective call of its own:
    # nothing can be copied out for another thread to write, so its saves block.
    async_capable: ClassVar[bool] = False

    def capture_states(self, rank: int, to_host: bool) -> dict[str, Any] | None:
        return None  # the engine's save_checkpoint reads its live state itself

    def write_states(self, states: dict[str, Any] | None, path: Path, meta: dict[str, Any], rank: int,
                     group: Any = None) -> None:
        publish_dir(path, dict(meta, format=FORMAT_DEEPSPEED), rank,
                    lambda tmp: self.model.save_checkpoint(str(tmp), tag="ds", save_latest=False))

    def load_states(self, path: Path, fmt: str) -> None:
        if fmt != FORMAT_DEEPSPEED:
            raise WorkerError(f"{path} is not a DeepSpeed checkpoint; training.strategy=deepspeed resumes only its own",
                              ExitCode.USAGE)
        self.model.load_checkpoint(str(path), tag="ds")
