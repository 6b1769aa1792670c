"""Where the training loop gets batches from: a small protocol, two sources.

The loop only needs `next_batch()`, `state_dict()` and `load_state_dict()`.
Real runs use dataset_cache's rank-sharded `BatchSampler` over the prepared
cache (or its `MixtureSampler` over a data.mix mixture); tests (and benchmarks)
feed the same protocol from tokens in memory.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from gpuherd.config import ConfigError


class BatchSource(Protocol):
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class DataBundle:
    """What a training run reads: a train source and a way to make validation batches."""

    train: BatchSource
    make_val: Callable[[], BatchSource] | None  # fresh sampler per eval: same val batches each time
    vocab_size: int  # the model's (padded) vocabulary
    tokenizer: str  # spec string, saved in checkpoints for generate.py
    describe: Callable[[int], str] | None = None  # tokens the run will draw -> the start-up "data:" line
    # data slot r's train batches at position 0 (a shrunk group carries a lost rank's slot); None: cannot
    for_slot: Callable[[int], BatchSource] | None = None


class ArraySampler:
    """Random windows from an in-memory token array, the same contract as
    dataset_cache.BatchSampler: each rank draws from its own seeded stream."""

    def __init__(self, tokens: np.ndarray, batch_size: int, context_length: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0) -> None:
        if len(tokens) <= context_length:
            raise ConfigError(f"{len(tokens)} tokens cannot fill a context of {context_length}")
        self.tokens = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
        self.batch_size, self.context_length = batch_size, context_length
        self.seed = seed * 1_000_003 + rank  # distinct stream per rank
        self.batches_drawn = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A generator per batch keyed by (seed, index): the position is the whole state.
        gen = torch.Generator().manual_seed(self.seed + 7919 * self.batches_drawn)
        starts = torch.randint(0, len(self.tokens) - self.context_length, (self.batch_size,), generator=gen)
        rows = torch.stack([self.tokens[s:s + self.context_length + 1] for s in starts.tolist()])
        self.batches_drawn += 1
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return {"batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches_drawn = int(state["batches_drawn"])


class TensorBatches:
    """dataset_cache.BatchSampler hands out numpy windows; the loop wants contiguous
    int64 tensors (pin_memory / non_blocking copies need them)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.sampler.next_batch()
        return (torch.from_numpy(np.ascontiguousarray(inputs, dtype=np.int64)),
                torch.from_numpy(np.ascontiguousarray(targets, dtype=np.int64)))

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


class Prefetched:
    """Batches drawn `depth` ahead by a background thread (`training.num_workers`), pinned
    for an asynchronous host-to-GPU copy, so the loop never waits on the sampler.

    The draw order is the source's, so training is bit-identical to drawing in the loop;
    `state_dict()` is the source's state after the last batch *handed out*, not after
    the ones drawn ahead, so a checkpoint resumes exactly where the loop was. Loading a
    state is only possible before the first batch (resume does it then)."""

    def __init__(self, source: BatchSource, depth: int, pin: bool) -> None:
        self.source, self.depth, self.pin = source, depth, pin
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._state: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                inputs, targets = self.source.next_batch()
                if self.pin:
                    inputs, targets = inputs.pin_memory(), targets.pin_memory()
                self._put((inputs, targets, self.source.state_dict()))
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
            self._put(exc)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():  # never blocks past close()
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._fill, name="gpuherd-batches", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        inputs, targets, self._state = item
        return inputs, targets

    def state_dict(self) -> dict[str, Any]:
        return self.source.state_dict() if self._state is None else self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("a prefetching batch source cannot be rewound once it started")
        self.source.load_state_dict(state)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def in_memory_bundle(train_tokens: np.ndarray, val_tokens: np.ndarray | None, vocab_size: int,
                     batch_size: int, context_length: int, rank: int, world_size: int, seed: int) -> DataBundle:
    def make_val() -> BatchSource:
        return ArraySampler(val_tokens, batch_size, context_length, rank, world_size, seed + 1)

    return DataBundle(
        train=ArraySampler(train_tokens, batch_size, context_length, rank, world_size, seed),
        make_val=make_val if val_tokens is not None else None,
        vocab_size=vocab_size,
        tokenizer="in-memory",
    )


def cache_bundle(cache_dir: Path, model_vocab: int, batch_size: int, context_length: int,
                 rank: int, world_size: int, seed: int, verify: bool = False) -> DataBundle:
    """Batches from a prepared dataset cache or mixture (dataset_cache's public API only)."""
    from dataset_cache import BatchSampler, MixtureSampler, TokenCache, describe_data, open_data, padded_vocab_size

    data = open_data(cache_dir, verify=verify)
    vocab = model_vocab or padded_vocab_size(data.vocab_size)
    if vocab < data.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_vocab} is smaller than the tokenizer's vocabulary ({data.vocab_size})"
        )
    sampler = BatchSampler if isinstance(data, TokenCache) else MixtureSampler

    def make_val() -> BatchSource:
        return TensorBatches(sampler(data, "val", batch_size, context_length, rank, world_size, seed + 1))

    return DataBundle(
        train=TensorBatches(sampler(data, "train", batch_size, context_length, rank, world_size, seed)),
        make_val=make_val,
        vocab_size=vocab,
        tokenizer=data.tokenizer,
        describe=lambda planned_tokens: describe_data(data, planned_tokens),
        for_slot=lambda slot: TensorBatches(sampler(data, "train", batch_size, context_length, slot, world_size, seed)),
    )
