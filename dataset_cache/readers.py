"""Record readers: one file in, its documents' texts out, streamed.

Formats: JSON Lines (plain, gzip, zstd), parquet (pyarrow, row group by row
group, only the text column), and the Arrow stream shards of a HuggingFace
`save_to_disk` directory (pyarrow; the `datasets` package is not needed).
Plain .txt files are read by `corpus.py` (one document per file, in blocks).

Every reader names a bad record by file and line (JSONL, counted from 1 as
editors do) or row (parquet and Arrow, counted from 0 as pyarrow and pandas
do) and hands it to `BadRecords`, which stops the build or counts the skip.

Each format has a version in READER_VERSIONS that goes into the cache key:
bump it whenever a reader's output for the same bytes changes.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from dataset_cache.bad_records import BadRecords, one_line
from gpuherd.errors import DatasetError

READER_VERSIONS = {"txt": 1, "jsonl": 1, "jsonl.gz": 1, "jsonl.zst": 1, "parquet": 1, "hf-arrow": 1}
SUFFIXES = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".jsonl.zst": "jsonl.zst", ".parquet": "parquet"}
KNOWN_SUFFIXES = ", ".join(list(SUFFIXES)[:-1]) + f" or {list(SUFFIXES)[-1]}"
COMPRESSED_BLOCK = 1 << 20  # compressed bytes per read: text inflates ~4x, so a few MB in memory at a time
PARQUET_BATCH_ROWS = 1024  # rows converted to Python strings at a time (a FineWeb row group holds far more)


def format_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((fmt for suffix, fmt in SUFFIXES.items() if name.endswith(suffix)), None)


def read_texts(path: Path, fmt: str, text_field: str, bad: BadRecords) -> Iterator[str]:
    """Each record's text, in file order; bad records go to `bad`."""
    if fmt == "parquet":
        return _parquet_texts(path, text_field, bad)
    if fmt == "hf-arrow":
        return _arrow_texts(path, text_field, bad)
    if fmt in ("jsonl", "jsonl.gz", "jsonl.zst"):
        return _jsonl_texts(path, fmt, text_field, bad)
    raise ValueError(f"no record reader for format {fmt!r}")


# --------------------------------------------------------------------------- JSON Lines


class _Truncated(Exception):
    """The compressed stream ends inside a frame."""


def _jsonl_texts(path: Path, fmt: str, field: str, bad: BadRecords) -> Iterator[str]:
    import zstandard

    corrupt = (gzip.BadGzipFile, EOFError, zlib.error, zstandard.ZstdError, _Truncated)
    line_no = 0
    with open_readable(path) as f:
        try:
            for line_no, raw in enumerate(_lines(f, fmt), start=1):
                text = _jsonl_text(raw, field, path, line_no, bad)
                if text is not None:
                    yield text
        except corrupt as exc:
            kind = "truncated" if isinstance(exc, (EOFError, _Truncated)) else "corrupt"
            bad.lost_tail(f"{path} line {line_no + 1}", f"{kind} {fmt.rsplit('.', 1)[-1]} stream ({one_line(exc)})")
        except OSError as exc:
            raise DatasetError(f"cannot read dataset file {path}: {exc.strerror or exc}") from None


def _jsonl_text(raw: bytes, field: str, path: Path, line_no: int, bad: BadRecords) -> str | None:
    if not raw.strip():
        return None
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        bad.record(f"{path} line {line_no}", f"not valid JSON ({exc.msg})")
        return None
    if not isinstance(record, dict) or field not in record:
        what = "an object without it" if isinstance(record, dict) else f"a JSON {_json_kind(record)}, not an object"
        bad.record(f"{path} line {line_no}", f"no string field '{field}' (the line is {what}; data.text_field names the key)")
        return None
    text = record[field]
    if not isinstance(text, str):
        bad.record(f"{path} line {line_no}", f"field '{field}' is {_json_kind(text)}, not a string")
        return None
    return text


def _json_kind(value: Any) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _lines(f: BinaryIO, fmt: str) -> Iterable[bytes]:
    if fmt == "jsonl":
        return f
    if fmt == "jsonl.gz":
        return gzip.GzipFile(fileobj=f)  # multi-member; raises on a bad CRC or a truncated member
    return _split_lines(_zstd_chunks(f))


def _zstd_chunks(f: BinaryIO) -> Iterator[bytes]:
    """Decompressed data of every frame in turn (concatenated .zst files are common).
    zstandard's stream_reader ends quietly at a truncated frame; this does not."""
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    frame = None
    while block := f.read(COMPRESSED_BLOCK):
        while block:
            frame = frame or dctx.decompressobj()
            if out := frame.decompress(block):
                yield out
            block, frame = (frame.unused_data, None) if frame.eof else (b"", frame)
    if frame is not None:
        raise _Truncated("the file ends inside a zstd frame")


def _split_lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    pending: list[bytes] = []  # the start of a line that spans chunks (joined once: linear in its length)
    for chunk in chunks:
        if b"\n" not in chunk:
            pending.append(chunk)
            continue
        lines = chunk.split(b"\n")
        lines[0] = b"".join([*pending, lines[0]])
        pending = [lines.pop()]
        yield from lines
    if tail := b"".join(pending):
        yield tail


# --------------------------------------------------------------------------- parquet and Arrow


def _parquet_texts(path: Path, field: str, bad: BadRecords) -> Iterator[str]:
    """Row group by row group, only the text column: memory holds one row group's
    column chunk at most, never the file. A row group with an undecodable page
    is lost from that page on (counted); the next row group is read normally."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, PermissionError | FileNotFoundError):
            raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None
        bad.lost_tail(str(path), f"not a readable parquet file ({one_line(exc)})")
        return
    with pf:
        _check_text_column(path, pf.schema_arrow, field)
        first_row = 0
        for group in range(pf.metadata.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            done = 0
            try:
                batches = pf.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group], columns=[field], use_threads=False)
                for batch in batches:
                    yield from _column_texts(batch.column(0), path, first_row + done, field, bad)
                    done += batch.num_rows
            except (OSError, pa.ArrowException) as exc:
                bad.record(f"{path} row {first_row + done}", f"corrupt parquet data in row group {group} "
                           f"({one_line(exc)})", count=rows - done)
            first_row += rows


def _arrow_texts(path: Path, field: str, bad: BadRecords) -> Iterator[str]:
    """One Arrow IPC stream shard of a `save_to_disk` directory, batch by batch."""
    import pyarrow as pa

    row = 0
    try:
        with pa.OSFile(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            _check_text_column(path, reader.schema, field)
            for batch in reader:
                yield from _column_texts(batch.column(field), path, row, field, bad)
                row += batch.num_rows
    except (OSError, pa.ArrowException) as exc:
        if isinstance(exc, PermissionError | FileNotFoundError):
            raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None
        bad.lost_tail(f"{path} row {row}", f"corrupt Arrow stream ({one_line(exc)})")


def _check_text_column(path: Path, schema: Any, field: str) -> None:
    """A missing or non-text column is a setting to fix, not a bad record: always an error."""
    import pyarrow as pa

    if field not in schema.names:
        raise DatasetError(
            f"{path}: no column '{field}' (columns: {', '.join(schema.names) or 'none'}); set data.text_field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DatasetError(f"{path}: column '{field}' holds {kind}, not text; set data.text_field to the text column")


def _column_texts(column: Any, path: Path, first_row: int, field: str, bad: BadRecords) -> Iterator[str]:
    for offset, text in enumerate(column.to_pylist()):
        if text is None:
            bad.record(f"{path} row {first_row + offset}", f"'{field}' is null, not a string")
        else:
            yield text


def open_readable(path: Path) -> BinaryIO:
    try:
        return open(path, "rb")  # noqa: SIM115 (the caller's with-block closes it)
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror}") from None
