"""What the loop computes in, and the optimizer every strategy starts from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from loguru import logger
from torch import nn

from gpuherd.config import Config


@dataclass
class Precision:
    """Autocast dtype (None = fp32) and whether a grad scaler is needed."""

    autocast_dtype: torch.dtype | None
    use_scaler: bool

    @classmethod
    def choose(cls, cfg: Config, device: torch.device) -> Precision:
        if not cfg.training.use_amp or device.type != "cuda":
            return cls(None, False)
        # including_emulation=False: V100/T4 "support" bf16 only by emulation, many times
        # slower than their fp16 tensor cores; they take the fp16 + scaler path.
        if cfg.training.amp_dtype == "bf16" and torch.cuda.is_bf16_supported(including_emulation=False):
            return cls(torch.bfloat16, False)
        if cfg.training.amp_dtype == "bf16":
            logger.warning("this GPU has no native bf16 (compute capability < 8.0); using fp16 autocast "
                           "with a gradient scaler")
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
