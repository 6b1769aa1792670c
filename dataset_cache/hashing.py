"""sha256 helpers: the cache key and the cache checksums are built from these."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import orjson

from gpuherd.text import has_undecodable

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
    return sha256_bytes(canonical_json([[key_name(name), digest] for name, digest in parts]))


def key_name(name: str) -> str | dict[str, str]:
    """A file name as the key sees it: itself when it is UTF-8 (every key made before stays the
    same), else its exact bytes, hex (`caf\\xe9.txt` in Latin-1): JSON holds no undecodable bytes,
    and two different names never share a key entry."""
    if not has_undecodable(name):
        return name
    return {"fs_bytes": os.fsencode(name).hex()}
