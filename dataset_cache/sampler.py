"""The rank-sharded, resumable batch sampler workers read training batches with.

Each epoch cuts the split into non-overlapping windows of `context_length + 1`
tokens, starting at a random offset in [0, context_length) (so window edges
move between epochs), and shuffles them with a generator seeded by
(seed, split, epoch). Every step consumes `world_size * batch_size` windows of
that permutation; rank r takes the r-th block of `batch_size`. So within one
step no two ranks read the same sample, no window repeats within an epoch, and
every rank computes the same permutation without talking to the others.

The position is two numbers (epoch, windows consumed in it), shared by all
ranks: a checkpoint from rank 0 resumes every rank exactly, and even a resume
with another world size continues where the run stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from loguru import logger

from dataset_cache.cache import SPLITS, TokenCache
from gpuherd.errors import DatasetError

STATE_VERSION = 1


class BatchSampler:
    def __init__(
        self, cache: TokenCache, split: str, batch_size: int, context_length: int,
        rank: int, world_size: int, seed: int,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if batch_size <= 0 or context_length <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad sampler shape: batch_size={batch_size}, context_length={context_length}, rank={rank}, world_size={world_size}"
            )
        self.cache, self.split = cache, split
        self.batch_size, self.context_length = batch_size, context_length
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.data = cache.tokens(split)
        self.epoch = 0
        self.consumed = 0  # windows of this epoch already handed out (to all ranks together)
        worst_case_windows = (self.data.size - self.context_length) // self.context_length
        if worst_case_windows < self.per_step:
            raise DatasetError(
                f"the {split} split has {self.data.size:,} tokens: fewer than the {self.per_step} windows of "
                f"{context_length + 1} tokens one step needs (batch_size {batch_size} x {world_size} ranks); "
                "use more data, a larger data.val_fraction or a smaller batch or context"
            )
        self._epoch_cache: tuple[int, int, np.ndarray] | None = None  # (epoch, offset, permutation)
        self._ramp = np.arange(context_length + 1, dtype=np.int64)

    @property
    def per_step(self) -> int:
        return self.world_size * self.batch_size

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 inputs [B, T] and the targets, the same windows shifted by one token."""
        offset, order = self._epoch_order()
        if self.consumed + self.per_step > order.size:  # too few windows left for every rank
            self.epoch += 1
            self.consumed = 0
            offset, order = self._epoch_order()
        first = self.consumed + self.rank * self.batch_size
        windows = order[first:first + self.batch_size]
        self.consumed += self.per_step
        rows = self.cache.check_tokens(read_windows(self.data, offset + windows * self.context_length, self._ramp))
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position; identical on every rank apart from `rank`."""
        return {
            "version": STATE_VERSION, "split": self.split, "seed": self.seed, "epoch": self.epoch,
            "consumed": self.consumed, "context_length": self.context_length, "cache_key": self.cache.key,
            "split_tokens": int(self.data.size), "batch_size": self.batch_size,
            "world_size": self.world_size, "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` stopped. A state from another cache, split,
        seed or context length describes other windows: that is said loudly and the
        split starts from its beginning rather than pretending to resume."""
        same_windows = {
            name: (state.get(name), mine) for name, mine in (
                ("version", STATE_VERSION), ("split", self.split), ("seed", self.seed),
                ("context_length", self.context_length), ("cache_key", self.cache.key),
                ("split_tokens", int(self.data.size)),
            ) if state.get(name) != mine
        }
        if same_windows:
            changed = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in same_windows.items())
            logger.warning(f"sampler state does not match this {self.split} sampler ({changed}); starting the split from the beginning")
            self.epoch, self.consumed = 0, 0
            return
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if epoch < 0 or consumed < 0:
            raise DatasetError(f"sampler state has a negative position (epoch {epoch}, consumed {consumed})")
        self.epoch, self.consumed = epoch, consumed

    def _epoch_order(self) -> tuple[int, np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != self.epoch:
            entropy = [self.seed, SPLITS.index(self.split), self.epoch]
            self._epoch_cache = (self.epoch, *epoch_windows(self.data.size, self.context_length, entropy))
        _, offset, order = self._epoch_cache
        return offset, order


def epoch_windows(n_tokens: int, context_length: int, entropy: list[int]) -> tuple[int, np.ndarray]:
    """One epoch: a random offset in [0, context_length) and a permutation of the
    windows of `context_length + 1` tokens that start at offset + k * context_length."""
    rng = np.random.default_rng(np.random.SeedSequence(entropy))
    offset = int(rng.integers(0, context_length))
    return offset, rng.permutation((n_tokens - 1 - offset) // context_length)


def read_windows(data: np.ndarray, starts: np.ndarray, ramp: np.ndarray) -> np.ndarray:
    """int64 rows data[start:start + len(ramp)], in the order of `starts`. Sorted reads
    touch the memmap front to back; the rows go back into order after."""
    sort = np.argsort(starts)
    rows = np.empty((starts.size, ramp.size), dtype=np.int64)
    rows[sort] = data[starts[sort][:, None] + ramp]
    return rows
