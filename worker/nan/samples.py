"""Naming the samples of a suspicious step: where each row of each micro-batch came from.

The loop hands the guard its batch source before drawing the step's batches; the
guard keeps the source's position (`state_dict()`, a few numbers, no data). On the
bad path a shallow copy of the sampler replays that position against a stand-in for
its token array that returns positions instead of tokens, so the sampler's own
`next_batch()` says where each window starts: no second copy of its window
arithmetic that could drift out of date. Every position is checked against the kept
batch; a source this module does not know, or a mismatch, leaves the rows named by
their place in the batch and their tokens only.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from loguru import logger

HEAD_TOKENS = 48  # tokens shown (and decoded) per sample


@dataclass
class SampleName:
    rank: int
    micro_batch: int
    row: int
    sample: int | None = None  # the sample's index in the sampler's order (within `epoch` for the dataset cache)
    epoch: int | None = None
    token_offset: int | None = None  # first token's offset in the token stream (tokens.bin: all splits)
    document: int | None = None  # index of the document holding the first token
    document_offset: int | None = None  # the first token's offset inside that document
    token_head: list[int] | None = None
    text_head: str | None = None

    def describe(self) -> str:
        where = f"rank {self.rank} micro-batch {self.micro_batch} row {self.row}"
        if self.sample is not None:
            where += f": sample {self.sample}" + (f" of epoch {self.epoch}" if self.epoch is not None else "")
        if self.token_offset is not None:
            where += f", token offset {self.token_offset}"
        if self.document is not None:
            where += f", document {self.document} at token {self.document_offset}"
        head = repr(self.text_head) if self.text_head is not None else str(self.token_head)
        return f"{where}: {head}"


@dataclass
class _Stream:
    """What the located windows index into."""

    tokens: Any  # indexable token array of the split (memmap / ndarray)
    base: int  # offset of tokens[0] in the whole token stream
    documents: np.ndarray | None  # document start offsets (+ the total), as the cache stores them
    tokenizer: str | None  # load_tokenizer() spec, for the text head


class _Positions:
    """Stands in for a token array: indexing it returns the indices themselves."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.asarray(index, dtype=np.int64)


class _PositionsCache:
    """The probe's cache: its rows are positions, not token ids, so the vocabulary check
    (which marks a cache damaged) must not judge them."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def check_tokens(self, rows: np.ndarray) -> np.ndarray:
        return rows


def input_rows(batch: Any) -> np.ndarray:
    """A kept micro-batch's token ids [B, T]: the inputs of an (inputs, targets) pair, or the ids."""
    ids = batch[0] if isinstance(batch, (tuple, list)) else batch
    return ids.detach().cpu().numpy()


def name_batch(source: Any, state: dict[str, Any] | None, batches: Sequence[Any], rank: int) -> list[SampleName]:
    """Every row of every micro-batch, located in the data when the source allows it."""
    rows = [input_rows(b) for b in batches]
    located, stream = _locate(source, state, len(rows)) if state is not None else (None, None)
    decode = _decoder(stream.tokenizer) if stream is not None else None
    names = []
    for m, micro in enumerate(rows):
        for r, row in enumerate(micro):
            name = SampleName(rank, m, r, token_head=[int(t) for t in row[:HEAD_TOKENS]])
            if located is not None and _matches(stream, located[m][r][2], row):
                name.sample, name.epoch, start = located[m][r]
                name.token_offset = stream.base + start
                name.document, name.document_offset = _document(stream.documents, name.token_offset)
            if decode is not None:
                name.text_head = decode(name.token_head)
            names.append(name)
    return names


def _locate(source: Any, state: dict[str, Any], micro_batches: int
            ) -> tuple[list[list[tuple[int, int | None, int]]] | None, _Stream | None]:
    """Per micro-batch and row: (sample index, epoch, start within the split's tokens)."""
    source = getattr(source, "source", source)  # worker.data.Prefetched wraps the real source
    sampler = getattr(source, "sampler", source)  # worker.data.TensorBatches wraps the cache's sampler
    try:
        if hasattr(sampler, "cache") and hasattr(sampler, "data"):
            return _locate_cache(sampler, state, micro_batches)
        if isinstance(getattr(sampler, "tokens", None), torch.Tensor):
            return _locate_array(sampler, state, micro_batches)
    except Exception as exc:  # noqa: BLE001 - naming is a courtesy on the bad path; never mask the fault
        logger.warning(f"cannot locate the batch's samples in the data ({type(exc).__name__}: {exc})")
    return None, None


def _locate_cache(sampler: Any, state: dict[str, Any], micro_batches: int) -> tuple[list, _Stream]:
    probe = copy.copy(sampler)
    probe.data = _Positions(int(sampler.data.size))
    probe.cache = _PositionsCache(sampler.cache)
    probe.load_state_dict(state)
    located = []
    for _ in range(micro_batches):
        starts, _ = probe.next_batch()
        first = probe.consumed - probe.per_step + probe.rank * probe.batch_size
        located.append([(first + i, probe.epoch, int(starts[i, 0])) for i in range(len(starts))])
    cache = sampler.cache
    stream = _Stream(tokens=sampler.data, base=int(cache.meta["splits"][sampler.split][0]),
                     documents=np.asarray(cache.document_offsets()), tokenizer=cache.tokenizer)
    return located, stream


def _locate_array(sampler: Any, state: dict[str, Any], micro_batches: int) -> tuple[list, _Stream]:
    probe = copy.copy(sampler)
    probe.tokens = torch.arange(len(sampler.tokens))
    probe.load_state_dict(state)
    located = []
    for _ in range(micro_batches):
        drawn = probe.batches_drawn
        starts, _ = probe.next_batch()
        located.append([(drawn * len(starts) + i, None, int(starts[i, 0])) for i in range(len(starts))])
    return located, _Stream(tokens=sampler.tokens.numpy(), base=0, documents=None, tokenizer=None)


def _matches(stream: _Stream, start: int, row: np.ndarray) -> bool:
    window = np.asarray(stream.tokens[start:start + len(row)])
    return window.shape == row.shape and bool((window.astype(np.int64) == row).all())


def _document(documents: np.ndarray | None, offset: int) -> tuple[int | None, int | None]:
    if documents is None or len(documents) < 2:
        return None, None
    index = int(np.searchsorted(documents[:-1], offset, side="right")) - 1
    if index < 0:
        return None, None
    return index, offset - int(documents[index])


def _decoder(spec: str | None) -> Any:
    if not spec:
        return None
    try:
        from dataset_cache import load_tokenizer

        return load_tokenizer(spec).decode
    except Exception as exc:  # noqa: BLE001 - a missing tokenizer file only costs the text head
        logger.warning(f"cannot load tokenizer {spec!r} to decode the batch ({type(exc).__name__}: {exc})")
        return None
