"""Where text comes from: local files (`inputs.py` finds them, `readers.py`
reads the record formats), the synthetic `dummy` set, or the fetched
Shakespeare plays (see `shakespeare.py`). A corpus is a sequence of documents;
what identifies its content goes into the cache key (`key_inputs`).

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
from typing import Any

from dataset_cache.bad_records import BadRecords
from dataset_cache.hash_memo import NO_MEMO, HashMemo
from dataset_cache.hashing import READ_BLOCK, sha256_of_parts
from dataset_cache.inputs import InputFile, resolve_inputs
from dataset_cache.readers import READER_VERSIONS, open_readable, read_texts
from gpuherd.errors import DatasetError


@dataclass(frozen=True)
class Piece:
    text: str
    ends_document: bool  # the tokenizer's end-of-text id follows this piece


class Corpus(ABC):
    spec: str  # as configured (data.dataset)
    name: str  # what the user recognizes it by (logs, metadata, --list)
    total_bytes: int  # raw size, for progress and throughput
    bad: BadRecords | None = None  # records skipped under data.on_bad_record=skip

    @abstractmethod
    def fingerprint(self) -> str:
        """sha256 of the raw text (over every file, named, in reading order)."""

    def key_inputs(self) -> dict[str, Any]:
        """What identifies this corpus's text in the cache key."""
        return {"name": self.name, "sha256": self.fingerprint()}

    @abstractmethod
    def pieces(self, max_chars: int, splittable: bool) -> Iterator[Piece]:
        """Every document in order, in pieces of about `max_chars` when splittable."""


class FileCorpus(Corpus):
    """Local files: a .txt file is one document; every other format holds one
    document per record (JSONL line, parquet or Arrow row)."""

    def __init__(self, spec: str, name: str, files: list[InputFile], memo: HashMemo = NO_MEMO,
                 text_field: str = "text", on_bad_record: str = "error") -> None:
        self.spec, self.name, self.files, self.memo = spec, name, files, memo
        self.text_field = text_field
        self.bad = BadRecords(on_bad_record)
        self.total_bytes = sum(_size(f.path) for f in files)
        self._fingerprint: str | None = None  # computed once: hashing twice would double the cost

    @classmethod
    def of_text_files(cls, spec: str, name: str, paths: list[Path], root: Path) -> FileCorpus:
        return cls(spec, name, [InputFile(p, p.relative_to(root).as_posix(), "txt") for p in paths])

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = sha256_of_parts((f.name, self._sha256(f.path)) for f in self.files)
        return self._fingerprint

    def key_inputs(self) -> dict[str, Any]:
        """Content, readers and text field; not the corpus's path (moving it keeps the cache)."""
        formats = sorted({f.fmt for f in self.files})
        inputs: dict[str, Any] = {"sha256": self.fingerprint(), "readers": {fmt: READER_VERSIONS[fmt] for fmt in formats}}
        if formats != ["txt"]:  # the text field changes nothing for plain text
            inputs["text_field"] = self.text_field
        return inputs

    def _sha256(self, path: Path) -> str:
        try:
            return self.memo.sha256(path)
        except OSError as exc:
            raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None

    def pieces(self, max_chars: int, splittable: bool) -> Iterator[Piece]:
        for file in self.files:
            if file.fmt == "txt":
                yield from _text_file_pieces(file.path, max_chars, splittable, self.bad)
                continue
            for text in read_texts(file.path, file.fmt, self.text_field, self.bad):
                if text:
                    yield from document_pieces(text, max_chars, splittable)


def local_corpus(spec: str, memo: HashMemo = NO_MEMO, text_field: str = "text", on_bad_record: str = "error") -> FileCorpus:
    """A file, a directory, a glob or a HuggingFace save_to_disk directory."""
    files = resolve_inputs(spec)
    return FileCorpus(spec, str(Path(spec).expanduser()), files, memo, text_field, on_bad_record)


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


def _text_file_pieces(path: Path, max_chars: int, splittable: bool, bad: BadRecords) -> Iterator[Piece]:
    buffer = ""
    for block in _decoded_blocks(path, bad):
        buffer += block
        if splittable and len(buffer) > 2 * max_chars:
            parts = list(split_points(buffer, max_chars))
            for part in parts[:-1]:
                yield Piece(part, False)
            buffer = parts[-1]
    if buffer:
        yield from document_pieces(buffer, max_chars, splittable)


def _decoded_blocks(path: Path, bad: BadRecords) -> Iterator[str]:
    """UTF-8 text in blocks; a byte that is not UTF-8 is named with its offset
    (and under on_bad_record=skip, the document ends before its block)."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")("strict")
    offset = 0
    with open_readable(path) as f:
        while True:
            block = f.read(READ_BLOCK)
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:
                bad.lost_tail(str(path), f"not UTF-8 text (byte 0x{block[exc.start]:02x} at offset {offset + exc.start})")
                return
            if text:
                yield text
            if not block:
                return
            offset += len(block)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None
