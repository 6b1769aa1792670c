"""Opening a published cache: check it against its own metadata, then memory-map it.

Sizes are checked on every open (a stat per file: microseconds); the full sha256
of every file only when asked (`verify=True`: `--verify-cache`,
`data.verify_cache`, and the first open after a build); every batch's token ids
against the vocabulary as it is read (`check_tokens`). Anything that does not
match raises CacheCorruptError, which `prepare_cache` answers with a rebuild
and a worker with exit code 3. What this leaves out: bytes changed after the
build into other in-vocabulary ids, with checksums off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson

from dataset_cache.build import METADATA_FILE, OFFSETS_DTYPE, OFFSETS_FILE, TOKENS_FILE
from dataset_cache.hashing import sha256_file
from dataset_cache.key import FORMAT_VERSION
from gpuherd.errors import CacheCorruptError, DatasetError
from gpuherd.files import write_bytes_atomic

SPLITS = ("train", "val")
DAMAGED_FILE = "damaged.txt"  # written by a reader that found bad tokens: the cache is refused from then on
ALL = "all"


class TokenCache:
    """A verified cache: read-only token memmaps per split, plus what produced them."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.key: str = path.name
        tokenizer = meta["tokenizer"]
        self.vocab_size: int = int(tokenizer["vocab_size"])
        self.tokenizer: str = str(tokenizer["spec"])  # what load_tokenizer() takes
        self.eot_id: int = int(tokenizer["eot_id"])
        self.dtype = np.dtype(meta["dtype"])
        self._all: np.memmap | None = None

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens as a read-only memmap (nothing is read until indexed);
        "all": both splits (a mixture's held-out validation source, and the training
        sources beside one, read every token)."""
        if split == ALL:
            return self._memmap()
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)} or {ALL}, got {split!r}")
        start, end = self.meta["splits"][split]
        return self._memmap()[start:end]

    def document_offsets(self) -> np.ndarray:
        """Start of every document in the token stream, then the total (uint64 memmap)."""
        return np.memmap(self.path / OFFSETS_FILE, dtype=OFFSETS_DTYPE, mode="r")

    @property
    def total_tokens(self) -> int:
        return int(self.meta["tokens"]["total"])

    def _memmap(self) -> np.memmap:
        if self._all is None:
            self._all = np.memmap(self.path / TOKENS_FILE, dtype=self.dtype, mode="r", shape=(self.total_tokens,))
        return self._all

    def check_tokens(self, rows: np.ndarray) -> np.ndarray:
        """`rows` (read from this cache) when every id is in the tokenizer's vocabulary; else the
        cache is damaged: marked so (the next prepare rebuilds it) and CacheCorruptError (exit 3),
        before such a batch reaches the model (an embedding lookup would fail with a bare IndexError)."""
        if rows.size and int(rows.max()) >= self.vocab_size:
            reason = (f"token id {int(rows.max())} is outside the vocabulary of tokenizer {self.tokenizer} "
                      f"({self.vocab_size} ids)")
            self.mark_damaged(reason)
            raise CacheCorruptError(f"dataset cache {self.path} is damaged: {reason}; it is not trained on, and the "
                                    "next run (or restart) rebuilds it")
        return rows

    def mark_damaged(self, reason: str) -> None:
        """Leave a note that makes every later open refuse this cache (and prepare rebuild it)."""
        try:
            write_bytes_atomic(self.path / DAMAGED_FILE, reason.encode() + b"\n")
        except OSError:  # a read-only cache: this run still stops; the sizes/checksums decide next time
            pass

    def __repr__(self) -> str:
        return f"TokenCache({self.path}, tokens={self.total_tokens:,}, tokenizer={self.tokenizer!r})"


def open_cache(path: Path, verify: bool = False) -> TokenCache:
    """Open the cache at `path` after checking sizes (and every checksum if `verify`)."""
    path = Path(path)
    if not path.is_dir():
        raise DatasetError(f"dataset cache not found: {path} (build it with prepare_dataset.py)")
    meta = read_metadata(path)
    _check_layout(path, meta)
    if (path / DAMAGED_FILE).exists():
        reason = (path / DAMAGED_FILE).read_text(errors="replace").strip()
        raise CacheCorruptError(f"dataset cache {path} was found damaged while training ({reason})")
    for name, record in meta["files"].items():
        file = path / name
        try:
            size = file.stat().st_size
        except OSError:
            raise CacheCorruptError(f"dataset cache {path}: {name} is missing") from None
        if size != record["bytes"]:
            raise CacheCorruptError(
                f"dataset cache {path}: {name} has {size:,} bytes, metadata says {record['bytes']:,} (truncated or overwritten)"
            )
        if verify and sha256_file(file) != record["sha256"]:
            raise CacheCorruptError(f"dataset cache {path}: {name} fails its sha256 checksum (corrupted bytes)")
    return TokenCache(path, meta)


def read_metadata(path: Path) -> dict[str, Any]:
    meta_path = path / METADATA_FILE
    try:
        meta = orjson.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise CacheCorruptError(f"dataset cache {path} has no {METADATA_FILE} (an incomplete build)") from None
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CacheCorruptError(f"dataset cache {path}: unreadable {METADATA_FILE} ({exc})") from None
    if not isinstance(meta, dict):
        raise CacheCorruptError(f"dataset cache {path}: {METADATA_FILE} is not an object")
    return meta


def _check_layout(path: Path, meta: dict[str, Any]) -> None:
    """The metadata is self-consistent: the files it names hold exactly its token counts."""
    try:
        if meta["format_version"] != FORMAT_VERSION:
            raise CacheCorruptError(
                f"dataset cache {path} has format {meta['format_version']}, this gpuherd reads {FORMAT_VERSION}"
            )
        itemsize = np.dtype(meta["dtype"]).itemsize
        total = int(meta["tokens"]["total"])
        files = meta["files"]
        (train_start, train_end), (val_start, val_end) = meta["splits"]["train"], meta["splits"]["val"]
        documents = int(meta["dataset"]["documents"])
        consistent = (
            files[TOKENS_FILE]["bytes"] == total * itemsize
            and files[OFFSETS_FILE]["bytes"] == (documents + 1) * OFFSETS_DTYPE.itemsize
            and train_start == 0 and train_end == val_start and val_end == total and 0 < train_end < total
            and all(key in meta["tokenizer"] for key in ("spec", "vocab_size", "eot_id"))
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheCorruptError(f"dataset cache {path}: {METADATA_FILE} lacks or mangles {exc}") from None
    if not consistent:
        raise CacheCorruptError(f"dataset cache {path}: {METADATA_FILE} contradicts itself (edited by hand?)")
