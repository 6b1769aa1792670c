"""Batches from a mixture: which source each window comes from, deterministic,
world-size independent and resumable exactly like BatchSampler.

The run reads one global stream of windows. Position i of that stream belongs
to a source chosen by blocks of about BLOCK positions: block b holds
floor(share_s * BLOCK * (b + 1)) - floor(share_s * BLOCK * b) positions of
source s, shuffled by a generator seeded by (seed, split, b). So the counts
never drift from the shares by more than one block, and the choice depends
only on (seed, position), never on how many ranks read the stream.

Each source is read as its own endless stream of windows: epoch after epoch,
each a seeded permutation at a random offset (as in BatchSampler), no window
skipped. Every step consumes `world_size * batch_size` positions; every rank
computes the whole step and keeps the r-th block of `batch_size` rows. The
position is therefore the global count plus each source's (epoch, consumed),
identical on every rank: a checkpoint resumes any world size on the same stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from loguru import logger

from dataset_cache.cache import SPLITS
from dataset_cache.mixture import Mixture
from dataset_cache.sampler import epoch_windows, read_windows
from gpuherd.errors import DatasetError

STATE_VERSION = 1
BLOCK = 1024  # positions per shuffled block: shares are exact at every block boundary
RANGE_CODES = {"train": 0, "val": 1, "all": 2}
MIX_TAG = 0x6D6978  # "mix": keeps the schedule's random stream apart from the window streams'


class WindowStream:
    """One source's windows, epoch after epoch."""

    def __init__(self, data: np.ndarray, context_length: int, entropy: list[int], name: str) -> None:
        if (data.size - context_length) // context_length < 1:
            raise DatasetError(
                f"data.mix source {name} has {data.size:,} tokens here: too few for one window of "
                f"{context_length + 1} tokens at every offset; use more data or a smaller data.context_length"
            )
        self.data, self.context_length, self.entropy = data, context_length, entropy
        self.epoch = 0
        self.consumed = 0
        self._order: tuple[int, int, np.ndarray] | None = None  # (epoch, offset, permutation)

    def take(self, count: int) -> np.ndarray:
        """Start offsets of the next `count` windows."""
        parts = []
        while count:
            offset, order = self._epoch_order()
            n = min(count, order.size - self.consumed)
            parts.append(offset + order[self.consumed:self.consumed + n] * self.context_length)
            self.consumed += n
            count -= n
            if self.consumed == order.size:
                self.epoch, self.consumed = self.epoch + 1, 0
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    def _epoch_order(self) -> tuple[int, np.ndarray]:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, *epoch_windows(self.data.size, self.context_length, [*self.entropy, self.epoch]))
        return self._order[1], self._order[2]


class MixSchedule:
    """Source index of every global position (see the module docstring)."""

    def __init__(self, shares: list[float], entropy: list[int]) -> None:
        self.scaled = np.asarray(shares, dtype=np.float64) * BLOCK
        self.entropy = entropy
        self._block: tuple[int, np.ndarray] | None = None

    def sources(self, start: int, count: int) -> np.ndarray:
        out = []
        block = self._block_of(start)
        while count:
            first, assignment = self._start(block), self._assignment(block)
            piece = assignment[start - first:start - first + count]
            out.append(piece)
            start, count, block = start + piece.size, count - piece.size, block + 1
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def _cumulative(self, block: int) -> np.ndarray:
        return np.floor(self.scaled * block).astype(np.int64)

    def _start(self, block: int) -> int:
        return int(self._cumulative(block).sum())

    def _block_of(self, position: int) -> int:
        block = position // BLOCK
        while block > 0 and self._start(block) > position:
            block -= 1
        while self._start(block + 1) <= position:
            block += 1
        return block

    def _assignment(self, block: int) -> np.ndarray:
        if self._block is None or self._block[0] != block:
            counts = self._cumulative(block + 1) - self._cumulative(block)
            rng = np.random.default_rng(np.random.SeedSequence([*self.entropy, block]))
            self._block = (block, rng.permutation(np.repeat(np.arange(counts.size), counts)))
        return self._block[1]


class MixtureSampler:
    """The BatchSampler protocol over a Mixture: next_batch, state_dict, load_state_dict."""

    def __init__(self, mixture: Mixture, split: str, batch_size: int, context_length: int,
                 rank: int, world_size: int, seed: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if batch_size <= 0 or context_length <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"bad sampler shape: batch_size={batch_size}, context_length={context_length}, rank={rank}, world_size={world_size}"
            )
        self.mixture, self.split, self.seed = mixture, split, seed
        self.batch_size, self.context_length, self.rank, self.world_size = batch_size, context_length, rank, world_size
        parts = mixture.parts(split)
        self.streams = []
        self._caches = [source.cache for source in parts]  # each stream's, for its token check
        for source in parts:
            which = source.train_range if split == "train" else source.val_range
            entropy = [seed, RANGE_CODES[which], int(source.cache.key, 16)]
            self.streams.append(WindowStream(source.cache.tokens(which), context_length, entropy, source.spec))
        shares = [s.train_share if split == "train" else s.val_share for s in parts]
        self.schedule = MixSchedule(shares, [seed, SPLITS.index(split), MIX_TAG])
        self.position = 0  # windows handed out so far, to all ranks together
        self._ramp = np.arange(context_length + 1, dtype=np.int64)

    @property
    def per_step(self) -> int:
        return self.world_size * self.batch_size

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 inputs [B, T] and the targets, the same windows shifted by one token."""
        sources = self.schedule.sources(self.position, self.per_step)
        starts = np.empty(sources.size, dtype=np.int64)
        for index, stream in enumerate(self.streams):  # every rank advances every stream alike
            where = np.flatnonzero(sources == index)
            if where.size:
                starts[where] = stream.take(where.size)
        self.position += self.per_step
        mine = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        rows = np.empty((self.batch_size, self.context_length + 1), dtype=np.int64)
        for index in np.unique(sources[mine]):
            where = np.flatnonzero(sources[mine] == index)
            rows[where] = self._caches[index].check_tokens(
                read_windows(self.streams[index].data, starts[mine][where], self._ramp))
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        """JSON-able position; identical on every rank apart from `rank`."""
        return {
            "version": STATE_VERSION, "kind": "mixture", "split": self.split, "seed": self.seed,
            "context_length": self.context_length, "mixture_key": self.mixture.key, "position": self.position,
            "streams": [[s.epoch, s.consumed] for s in self.streams],
            "batch_size": self.batch_size, "world_size": self.world_size, "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` stopped; a state that describes another
        stream (another mixture, seed, split or context) restarts it loudly."""
        expected = (("version", STATE_VERSION), ("kind", "mixture"), ("split", self.split), ("seed", self.seed),
                    ("context_length", self.context_length), ("mixture_key", self.mixture.key))
        changed = [f"{name} {state.get(name)!r} -> {mine!r}" for name, mine in expected if state.get(name) != mine]
        if changed or len(state.get("streams", ())) != len(self.streams):
            logger.warning(f"sampler state does not match this {self.split} mixture "
                           f"({', '.join(changed) or 'source count'}); starting the mixture from the beginning")
            self.position = 0
            for stream in self.streams:
                stream.epoch, stream.consumed = 0, 0
            return
        heads = [(int(epoch), int(consumed)) for epoch, consumed in state["streams"]]
        if int(state["position"]) < 0 or any(e < 0 or c < 0 for e, c in heads):
            raise DatasetError(f"mixture sampler state has a negative position: {state['position']}, {heads}")
        self.position = int(state["position"])
        for stream, (epoch, consumed) in zip(self.streams, heads, strict=True):
            stream.epoch, stream.consumed = epoch, consumed
