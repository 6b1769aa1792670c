"""sha256 helpers: the cache key and the cache checksums are built from these."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import orjson

READ_BLOCK = 4 << 20  # 4 MiB: large enough for full disk speed, small enough for bounded memory


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: object) -> bytes:
    """One byte string per value: sorted keys, no whitespace, so equal inputs hash equal."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def sha256_of_parts(parts: Iterable[tuple[str, str]]) -> str:
    """Digest of named digests (e.g. file name -> sha256), order as given."""
    return sha256_bytes(canonical_json([[name, digest] for name, digest in parts]))
