"""Build one cache directory: tokenize the corpus into a temp directory beside the
final one, fsync, write metadata.json last, rename into place.

The caller holds the key's lock. Until the rename nothing is visible under the
key, so a builder killed at any moment leaves only a `.tmp-<key>-*` directory
that no reader ever opens and the next builder deletes.
"""

from __future__ import annotations

import os
import shutil
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger

from dataset_cache.corpus import Corpus
from dataset_cache.durable import publish_dir, temp_dir_beside
from dataset_cache.hashing import canonical_json
from dataset_cache.key import FORMAT_VERSION, CacheKey
from dataset_cache.parallel import BATCH_CHARS, MIN_PARALLEL_BYTES, default_workers, encode_pieces
from dataset_cache.progress import BuildProgress
from dataset_cache.split import split_index
from dataset_cache.tokenizers import Tokenizer, token_dtype
from dataset_cache.writer import ArrayWriter, FileRecord
from gpuherd.errors import DatasetError
from gpuherd.files import write_bytes_atomic

TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.bin"  # uint64 start of every document, then the total
METADATA_FILE = "metadata.json"
OFFSETS_DTYPE = np.dtype(np.uint64)


def temp_prefix(short_key: str) -> str:
    return f".tmp-{short_key}"


def build_cache(
    final_dir: Path,
    key: CacheKey,
    tokenizer: Tokenizer,
    corpus: Corpus,
    *,
    context_length: int,
    num_samples: int,
    val_fraction: float,
    workers: int | None = None,
) -> dict[str, Any]:
    """Write the cache for `key` at `final_dir`; returns its metadata."""
    dtype = token_dtype(tokenizer.vocab_size)
    if workers is None:
        workers = default_workers() if corpus.total_bytes >= MIN_PARALLEL_BYTES else 1
    logger.info(
        f"building dataset cache {key.short}: {corpus.name} ({corpus.total_bytes / 1e6:,.1f} MB) with {tokenizer.name}, "
        f"{workers} process{'es' if workers > 1 else ''}"
    )
    progress = BuildProgress(label=corpus.name, total_bytes=corpus.total_bytes, doc_limit=num_samples)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with temp_dir_beside(final_dir, temp_prefix(key.short)) as tmp:
        token_record, offsets_record, total, documents = _tokenize_into(
            tmp, corpus, tokenizer, dtype, workers, num_samples, progress
        )
        split = _split_record(tmp, total, val_fraction, context_length, corpus.name)
        seconds = progress.elapsed
        meta = {
            "format_version": FORMAT_VERSION,
            "key": key.digest,
            "key_inputs": key.inputs,
            "tokenizer": _tokenizer_record(tokenizer),
            "dataset": {
                "spec": corpus.spec, "name": corpus.name, "sha256": key.inputs["dataset"]["sha256"],
                "documents": documents, "text_bytes": progress.text_bytes,
                "skipped": corpus.bad.as_dict() if corpus.bad else None,
            },
            "dtype": dtype.name,
            "context_length": context_length,
            "num_samples": num_samples,
            "val_fraction": val_fraction,
            **split,
            "files": {TOKENS_FILE: token_record.as_dict(), OFFSETS_FILE: offsets_record.as_dict()},
            "build": _build_record(seconds, workers, progress.text_bytes),
        }
        write_bytes_atomic(tmp / METADATA_FILE, canonical_json(meta))  # last: its presence means complete
        publish_dir(tmp, final_dir)
    _log_built(key.short, corpus, meta, seconds)
    return meta


def _split_record(tmp: Path, total: int, val_fraction: float, context_length: int, name: str) -> dict[str, Any]:
    """The metadata entries that say where train ends and val begins (a document boundary
    where one fits), read from the offsets file just written."""
    if total == 0:
        raise DatasetError(f"dataset {name} holds no text (every document is empty)")
    doc_offsets = np.memmap(tmp / OFFSETS_FILE, dtype=OFFSETS_DTYPE, mode="r")  # bounded memory for any count
    n_train = split_index(doc_offsets, total, val_fraction, context_length, name)
    return {
        "tokens": {"total": total, "train": n_train, "val": total - n_train},
        "splits": {"train": [0, n_train], "val": [n_train, total]},
        "split_at_document_boundary": _is_offset(doc_offsets, n_train),
    }


def _log_built(short: str, corpus: Corpus, meta: dict[str, Any], seconds: float) -> None:
    """The closing lines of a build, from the metadata it wrote."""
    documents, tokens = meta["dataset"]["documents"], meta["tokens"]
    logger.info(
        f"built dataset cache {short}: {documents:,} documents, {tokens['total']:,} tokens "
        f"({tokens['train']:,} train / {tokens['val']:,} val) in {seconds:.2f} s, {meta['build']['mb_per_s']:.1f} MB/s"
    )
    if corpus.bad and corpus.bad.any:
        logger.warning(f"dataset cache {short}: {corpus.bad.summary()}")


def _is_offset(doc_offsets: np.ndarray, position: int) -> bool:
    """Binary search: np.isin would copy and sort every offset (8 bytes per document)."""
    i = int(np.searchsorted(doc_offsets, position))
    return i < doc_offsets.size and int(doc_offsets[i]) == position


def _tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    return {
        "spec": tokenizer.spec, "name": tokenizer.name, "sha256": tokenizer.fingerprint,
        "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
    }


def _build_record(seconds: float, workers: int, text_bytes: int) -> dict[str, Any]:
    return {
        "seconds": round(seconds, 3), "workers": workers, "pid": os.getpid(), "host": socket.gethostname(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "mb_per_s": round(text_bytes / 1e6 / max(seconds, 1e-9), 2),
    }


def _tokenize_into(
    tmp: Path, corpus: Corpus, tokenizer: Tokenizer, dtype: np.dtype, workers: int, num_samples: int,
    progress: BuildProgress,
) -> tuple[FileRecord, FileRecord, int, int]:
    """tokens.bin and doc_offsets.bin in `tmp`: their records, the token and the document count."""
    tokens = ArrayWriter(tmp / TOKENS_FILE, dtype)
    offsets = ArrayWriter(tmp / OFFSETS_FILE, OFFSETS_DTYPE)
    offsets.append(np.zeros(1))
    try:
        pieces = corpus.pieces(BATCH_CHARS, tokenizer.splittable)
        for batch in encode_pieces(tokenizer, pieces, dtype, workers, doc_limit=num_samples):
            base = tokens.count
            tokens.append(batch.tokens)
            offsets.append(np.asarray(batch.doc_ends, dtype=np.int64) + base)
            progress.update(batch.text_bytes, int(batch.tokens.size), len(batch.doc_ends))
    except BaseException:
        tokens.abort()
        offsets.abort()
        raise
    return tokens.close(), offsets.close(), tokens.count, offsets.count - 1


def remove_stale_temps(cache_dir: Path, short_key: str) -> None:
    """Leftovers of builders that died; only called while holding the key's lock,
    so no live builder can own one of them."""
    for leftover in cache_dir.glob(f"{temp_prefix(short_key)}-*"):
        logger.info(f"removing the leftover of an interrupted build: {leftover}")
        shutil.rmtree(leftover, ignore_errors=True)

