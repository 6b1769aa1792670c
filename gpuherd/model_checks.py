"""Checks that need more than the config itself, done before anything is spawned or
written: the tokenizer's vocabulary against `model.vocab_size`, and the model's
memory against what a worker will have. Torch-free: the caller brings the numbers
(the tokenizer's size from dataset_cache, device memory from NVML or torch, host RAM
from `host_memory_bytes`). Each returns None or one line for a ConfigError (exit 2).
"""

from __future__ import annotations

import psutil

from gpuherd.config import Config
from gpuherd.model_size import ModelMemory, estimate_bytes
from gpuherd.storage import format_bytes

VOCAB_MULTIPLE = 64  # the worker pads the tokenizer's vocabulary to this (dataset_cache.padded_vocab_size)
# Host RAM of one built-in worker or warm spare before any model: a Python process that imported
# torch (measured: about 220 MB resident with torch 2.x on CPU), rounded up.
PROCESS_FLOOR_BYTES = 256 * 1024**2


def check_vocab(cfg: Config, tokenizer_vocab: int) -> str | None:
    want = cfg.model.vocab_size
    if want and want < tokenizer_vocab:
        return (f"model.vocab_size={want} is smaller than the vocabulary of tokenizer {cfg.data.tokenizer} "
                f"({tokenizer_vocab} tokens); set it to 0 (the tokenizer's, padded) or at least {tokenizer_vocab}")
    return None


def worker_memory(cfg: Config, world_size: int, tokenizer_vocab: int | None) -> ModelMemory:
    """One worker's estimated training memory, the tokenizer's vocabulary padded as the worker pads it."""
    vocab = None if tokenizer_vocab is None else -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    return estimate_bytes(cfg.model, cfg.training, world_size, context_length=cfg.data.context_length,
                          vocab_size=vocab)


def check_fits(cfg: Config, device_bytes: int, *, world_size: int = 1, tokenizer_vocab: int | None = None,
               where: str = "the device") -> str | None:
    """None when one worker's estimated training memory fits in `device_bytes`, else why not."""
    need = worker_memory(cfg, world_size, tokenizer_vocab)
    if need.total <= device_bytes:
        return None
    return (f"the model does not fit: training it needs at least ~{format_bytes(need.total)} per worker "
            f"({need.params / 1e6:,.1f}M parameters: ~{format_bytes(need.state_bytes)} for weights, gradients and "
            f"optimizer, ~{format_bytes(need.activation_bytes)} of activations) but {where} has "
            f"{format_bytes(device_bytes)}; make model.dim, model.n_layers or training.batch_size smaller, "
            "or shard it (training.strategy=fsdp)")


def check_processes_fit(workers: int, spares: int, model_bytes: int, available: int,
                        copy_bytes: int = 0) -> str | None:
    """None when `workers` (each holding `model_bytes` of training state in host RAM: CPU
    workers, and `copy_bytes` of live recovery's shard copies: FSDP, gpuherd/memory_plan.py) and
    `spares` waiting warm spares (a promoted one takes the place of a worker whose memory went
    with it) fit in `available` bytes of this host's RAM, else why not. Every count that
    multiplies processes is bounded here, before the first one starts: past this, the machine
    runs out of memory instead."""
    each = PROCESS_FLOOR_BYTES + model_bytes + copy_bytes
    need = workers * each + spares * PROCESS_FLOOR_BYTES
    if need <= available:
        return None
    what = f"{workers} worker(s) and {spares} warm spare(s) (--spares)" if spares else f"{workers} worker(s)"
    room = max(0, (available - workers * each) // PROCESS_FLOOR_BYTES) if spares else available // each
    hint = f"at most {room} spare(s) fit beside the workers: lower --spares" if spares and available >= workers * each \
        else f"about {available // each} worker(s) fit: lower --nproc, or use more nodes (--nnodes)"
    worker = f"a worker {format_bytes(each)}: torch" + (" and the model" if model_bytes else "") + \
        (f" and {format_bytes(copy_bytes)} of shard copies (system.shard_copies)" if copy_bytes else "")
    spare = f"; a spare {format_bytes(PROCESS_FLOOR_BYTES)}: torch" if spares else ""
    return (f"{what} need about {format_bytes(need)} of RAM ({worker}{spare}) but this host has "
            f"{format_bytes(available)} available; {hint}")


def host_memory_bytes(workers_on_host: int = 1) -> int:
    """RAM one of `workers_on_host` CPU workers can count on: what the OS could hand out
    now without swapping, shared evenly."""
    return psutil.virtual_memory().available // max(1, workers_on_host)
