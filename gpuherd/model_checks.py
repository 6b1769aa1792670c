"""Checks that need more than the config itself, done before anything is spawned or
written: the tokenizer's vocabulary against `model.vocab_size`, and the model's
memory against what a worker will have. Torch-free: the caller brings the numbers
(the tokenizer's size from dataset_cache, device memory from NVML or torch, host RAM
from `host_memory_bytes`). Each returns None or one line for a ConfigError (exit 2).
"""

from __future__ import annotations

import psutil

from gpuherd.config import Config
from gpuherd.model_size import estimate_bytes
from gpuherd.storage import format_bytes

VOCAB_MULTIPLE = 64  # the worker pads the tokenizer's vocabulary to this (dataset_cache.padded_vocab_size)


def check_vocab(cfg: Config, tokenizer_vocab: int) -> str | None:
    want = cfg.model.vocab_size
    if want and want < tokenizer_vocab:
        return (f"model.vocab_size={want} is smaller than the vocabulary of tokenizer {cfg.data.tokenizer} "
                f"({tokenizer_vocab} tokens); set it to 0 (the tokenizer's, padded) or at least {tokenizer_vocab}")
    return None


def check_fits(cfg: Config, device_bytes: int, *, world_size: int = 1, tokenizer_vocab: int | None = None,
               where: str = "the device") -> str | None:
    """None when one worker's estimated training memory fits in `device_bytes`, else why not."""
    vocab = None if tokenizer_vocab is None else -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    need = estimate_bytes(cfg.model, cfg.training, world_size, context_length=cfg.data.context_length,
                          vocab_size=vocab)
    if need.total <= device_bytes:
        return None
    return (f"the model does not fit: training it needs at least ~{format_bytes(need.total)} per worker "
            f"({need.params / 1e6:,.1f}M parameters: ~{format_bytes(need.state_bytes)} for weights, gradients and "
            f"optimizer, ~{format_bytes(need.activation_bytes)} of activations) but {where} has "
            f"{format_bytes(device_bytes)}; make model.dim, model.n_layers or training.batch_size smaller, "
            "or shard it (training.strategy=fsdp)")


def host_memory_bytes(workers_on_host: int = 1) -> int:
    """RAM one of `workers_on_host` CPU workers can count on: what the OS could hand out
    now without swapping, shared evenly."""
    return psutil.virtual_memory().available // max(1, workers_on_host)
