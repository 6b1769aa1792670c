"""Where text comes from: local files, the synthetic `dummy` set, or the fetched
Shakespeare plays (see `shakespeare.py`). A corpus is a sequence of documents
with a name and the sha256 of its raw text, both part of the cache key.

Documents are streamed as `Piece`s so that neither a huge file nor a huge
corpus ever has to fit in memory; a splittable tokenizer gets long documents in
pieces cut where cutting cannot change the token ids.
"""

from __future__ import annotations

import codecs
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from dataset_cache.errors import DatasetError
from dataset_cache.hash_memo import NO_MEMO, HashMemo
from dataset_cache.hashing import READ_BLOCK, sha256_of_parts

TEXT_SUFFIXES = (".txt",)
JSONL_SUFFIXES = (".jsonl",)


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool  # the tokenizer's end-of-text id follows this piece


class Corpus(ABC):
    spec: str  # as configured (data.dataset)
    name: str  # stable name that goes into the key
    total_bytes: int  # raw size, for progress and throughput

    @abstractmethod
    def fingerprint(self) -> str:
        """sha256 of the raw text (over every file, named, in reading order)."""

    @abstractmethod
    def pieces(self, max_chars: int, splittable: bool) -> Iterator[Piece]:
        """Every document in order, in pieces of about `max_chars` when splittable."""


class FileCorpus(Corpus):
    """Plain text files (one document each) and JSONL files (one document per line)."""

    def __init__(self, spec: str, name: str, files: list[Path], root: Path, memo: HashMemo = NO_MEMO) -> None:
        self.spec, self.name, self.files, self.root, self.memo = spec, name, files, root, memo
        self.total_bytes = sum(_size(p) for p in files)
        self._fingerprint: str | None = None  # computed once: hashing twice would double the cost

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = sha256_of_parts((_relative(p, self.root), self._sha256(p)) for p in self.files)
        return self._fingerprint

    def _sha256(self, path: Path) -> str:
        try:
            return self.memo.sha256(path)
        except OSError as exc:
            raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None

    def pieces(self, max_chars: int, splittable: bool) -> Iterator[Piece]:
        for path in self.files:
            if path.suffix.lower() in JSONL_SUFFIXES:
                yield from _jsonl_pieces(path, max_chars, splittable)
            else:
                yield from _text_file_pieces(path, max_chars, splittable)


def local_corpus(spec: str, memo: HashMemo = NO_MEMO) -> FileCorpus:
    """A .txt/.jsonl file, or a directory searched recursively for them."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise DatasetError(f"data.dataset path not found: {path} (use a .txt or .jsonl file, a directory of them, shakespeare or dummy)")
    path = path.resolve()
    if path.is_file():
        return FileCorpus(spec, str(path), [path], path.parent, memo)
    if not path.is_dir():
        raise DatasetError(f"data.dataset {path} is neither a regular file nor a directory")
    files = sorted(
        (p for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES and p.is_file()
         and not any(part.startswith(".") for part in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise DatasetError(f"data.dataset directory {path} holds no .txt or .jsonl files")
    return FileCorpus(spec, str(path), files, path, memo)


def document_pieces(text: str, max_chars: int, splittable: bool) -> Iterator[Piece]:
    """One whole document as pieces, the last one marked as its end."""
    parts = list(split_points(text, max_chars)) if splittable else [text]
    for part in parts[:-1]:
        yield Piece(part, False)
    yield Piece(parts[-1], True)


def split_points(text: str, max_chars: int) -> Iterator[str]:
    """Cut `text` into pieces of at least `max_chars`, each cut just before a newline
    that follows a non-space character. GPT-2's pre-tokenizer never puts a
    non-space and the whitespace after it into one token, and nothing it matches
    looks backwards, so the pieces encode to exactly the ids of the whole (tested)."""
    start = 0
    while len(text) - start > max_chars:
        cut = _safe_cut(text, start + max_chars)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _safe_cut(text: str, at_least: int) -> int | None:
    i = text.find("\n", max(at_least, 1))
    while i != -1:
        if not text[i - 1].isspace():
            return i
        i = text.find("\n", i + 1)
    return None


def _text_file_pieces(path: Path, max_chars: int, splittable: bool) -> Iterator[Piece]:
    buffer = ""
    for block in _decoded_blocks(path):
        buffer += block
        if splittable and len(buffer) > 2 * max_chars:
            parts = list(split_points(buffer, max_chars))
            for part in parts[:-1]:
                yield Piece(part, False)
            buffer = parts[-1]
    if buffer:
        yield from document_pieces(buffer, max_chars, splittable)


def _jsonl_pieces(path: Path, max_chars: int, splittable: bool) -> Iterator[Piece]:
    with _open_readable(path) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                raise DatasetError(f"{path} line {line_no}: not valid JSON ({exc.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DatasetError(f"{path} line {line_no}: no string field 'text' (each JSONL line must be {{\"text\": \"...\"}})")
            if text:
                yield from document_pieces(text, max_chars, splittable)


def _decoded_blocks(path: Path) -> Iterator[str]:
    """UTF-8 text in blocks; a byte that is not UTF-8 is named with its offset."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    offset = 0
    with _open_readable(path) as f:
        while True:
            block = f.read(READ_BLOCK)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{path} is not UTF-8 text (byte 0x{block[exc.start]:02x} at offset {offset + exc.start}); "
                    "data.dataset takes .txt or .jsonl files or a directory of them"
                ) from None
            if text:
                yield text
            if not block:
                return
            offset += len(block)


def _open_readable(path: Path):  # noqa: ANN202 (a binary file object)
    try:
        return open(path, "rb")
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None


def _relative(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()
