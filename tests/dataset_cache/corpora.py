"""Test corpora: the same documents written as .txt files, JSON Lines (plain,
gzip, zstd), parquet (several row groups) or a HuggingFace save_to_disk
directory, so every reader can be checked against one expected token stream."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import orjson

FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet")


def documents(count: int, alphabet: str = "abcdefghij", seed: int = 0) -> list[str]:
    """`count` documents of 20-200 characters drawn from `alphabet` and spaces
    (two sources with disjoint alphabets tell their windows apart by content)."""
    rng = random.Random(seed)
    return [
        " ".join("".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(rng.randint(4, 30)))
        for _ in range(count)
    ]


def byte_stream(docs: list[str]) -> list[int]:
    """What the byte tokenizer stores: each document's bytes, then eot (0)."""
    return [b for doc in docs for b in [*doc.encode(), 0]]


def jsonl_bytes(docs: list[str], field: str = "text") -> bytes:
    return b"".join(orjson.dumps({"id": i, field: doc}) + b"\n" for i, doc in enumerate(docs))


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def write_parquet(path: Path, docs: list[str | None], field: str = "text", row_group_size: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=row_group_size)
    return path


def write_corpus(directory: Path, fmt: str, docs: list[str], field: str = "text") -> Path:
    """`docs` in format `fmt` under `directory`; returns what data.dataset should name."""
    directory.mkdir(parents=True, exist_ok=True)
    if fmt == "txt":  # one document per file; names sort in document order
        for i, doc in enumerate(docs):
            (directory / f"doc{i:04d}.txt").write_text(doc)
        return directory
    path = directory / f"corpus.{fmt}"
    if fmt == "parquet":
        return write_parquet(path, docs, field)
    data = jsonl_bytes(docs, field)
    if fmt == "jsonl.gz":
        data = gzip.compress(data)
    elif fmt == "jsonl.zst":
        data = zstd(data)
    path.write_bytes(data)
    return path
