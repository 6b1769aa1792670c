"""Bad records and undecodable files: one line naming file, line or row and
reason, exit 3, nothing published; or, with data.on_bad_record=skip, a build
without them whose summary counts them."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataset_cache import DatasetError, open_cache, prepare_cache
from tests.dataset_cache.corpora import byte_stream, documents, jsonl_bytes, write_parquet, zstd
from tests.dataset_cache.helpers import capture_loguru, data_config, run_prepare_cli

DOCS = documents(40)
RECORD = "; data.on_bad_record=skip skips such records"
TAIL = "; data.on_bad_record=skip skips the rest of such a file"
caplog_loguru = pytest.fixture(capture_loguru)


def _jsonl_with(line: bytes) -> bytes:
    return jsonl_bytes(DOCS[:2]) + line + b"\n" + jsonl_bytes(DOCS[2:4])


def _corrupt_page(path: Path) -> None:
    """Overwrite the page header of row group 1's text column."""
    write_parquet(path, DOCS, row_group_size=16)
    column = pq.ParquetFile(path).metadata.row_group(1).column(1)
    start = column.dictionary_page_offset or column.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start:start + 8] = b"\xff" * 8
    path.write_bytes(bytes(raw))


def _truncated_gzip(path: Path) -> None:
    data = gzip.compress(jsonl_bytes(DOCS))
    path.write_bytes(data[:len(data) // 2])


# name -> (writer, the error line after "<path>" as a regex)
CASES = {
    "number.jsonl": (lambda p: p.write_bytes(_jsonl_with(b'{"text": 5}')),
                     re.escape(" line 3: field 'text' is number, not a string" + RECORD)),
    "null.jsonl": (lambda p: p.write_bytes(_jsonl_with(b'{"text": null}')),
                   re.escape(" line 3: field 'text' is null, not a string" + RECORD)),
    "missing.jsonl.zst": (lambda p: p.write_bytes(zstd(_jsonl_with(b'{"body": "x"}'))),
                          re.escape(" line 3: no string field 'text' (the line is an object without it; "
                                    "data.text_field names the key)" + RECORD)),
    "truncated.jsonl.zst": (lambda p: p.write_bytes(zstd(jsonl_bytes(DOCS[:3])) + zstd(jsonl_bytes(DOCS[3:4]))[:-6]),
                            re.escape(" line 4: truncated zst stream (the file ends inside a zstd frame)" + TAIL)),
    "garbage.jsonl.zst": (lambda p: p.write_bytes(b"not zstd at all\n"),
                          re.escape(" line 1: corrupt zst stream (zstd decompressor error: Unknown frame descriptor)" + TAIL)),
    "truncated.jsonl.gz": (_truncated_gzip,
                           r" line \d+: truncated gz stream \(Compressed file ended before the end-of-stream marker "
                           r"was reached\)" + re.escape(TAIL)),
    "null.parquet": (lambda p: write_parquet(p, DOCS[:5] + [None] + DOCS[6:]),
                     re.escape(" row 5: 'text' is null, not a string" + RECORD)),
    "page.parquet": (_corrupt_page, r" row 16: corrupt parquet data in row group 1 \([^()]+\)" + re.escape(RECORD)),
    "text.parquet": (lambda p: p.write_text("plain text, not parquet"),
                     r": not a readable parquet file \([^()]+\)" + re.escape(TAIL)),
    "content.parquet": (lambda p: write_parquet(p, DOCS, field="content"),
                        re.escape(": no column 'text' (columns: id, content); set data.text_field")),
    "ints.parquet": (lambda p: pq.write_table(pa.table({"text": [1, 2, 3]}), p),
                     re.escape(": column 'text' holds int64, not text; set data.text_field to the text column")),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_gives_one_line_and_exit_3(tmp_path, name):
    write, expected = CASES[name]
    path = tmp_path / name
    write(path)
    cache = tmp_path / "cache"
    done = run_prepare_cli("--set", f"data.dataset={path}", "--set", "data.tokenizer=byte",
                           "--set", f"data.cache_dir={cache}", "--set", "data.context_length=8", cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(re.escape(f"prepare_dataset.py: error: {path}") + expected, line), line
    assert not list(cache.glob("[0-9a-f]*")) and not list(cache.glob(".tmp-*"))  # nothing published or left


def test_unsupported_file_names_the_formats(tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b\n")
    with pytest.raises(DatasetError) as caught:
        prepare_cache(data_config(tmp_path, dataset=str(path)))
    assert str(caught.value) == f"data.dataset {path} is not a supported file (use .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet)"


def test_skip_drops_bad_records_and_counts_them(tmp_path, caplog_loguru):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_bytes(jsonl_bytes(DOCS[:10]) + b'{"text": 7}\n{broken\n' + jsonl_bytes(DOCS[10:20]))
    write_parquet(corpus / "b.parquet", DOCS[20:25] + [None] + DOCS[26:40])
    (corpus / "c.jsonl.zst").write_bytes(zstd(jsonl_bytes(DOCS[:3])) + zstd(jsonl_bytes(DOCS[3:4]))[:-6])
    info = prepare_cache(data_config(tmp_path, dataset=str(corpus), num_samples=0, on_bad_record="skip"))
    cache = open_cache(info.path)
    kept = DOCS[:20] + DOCS[20:25] + DOCS[26:40] + DOCS[:3]
    assert np.concatenate([cache.tokens("train"), cache.tokens("val")]).tolist() == byte_stream(kept)
    skipped = cache.meta["dataset"]["skipped"]
    assert skipped == {"records": 3, "lost_tails": 1, "first": f"{corpus / 'a.jsonl'} line 11: field 'text' is number, not a string"}
    assert any(f"skipped 3 bad records and the undecodable rest of 1 file (first: {corpus / 'a.jsonl'} line 11" in m
               for m in caplog_loguru)


def test_a_skip_built_cache_is_refused_under_error(tmp_path):
    """The cache lacks records that on_bad_record=error promises to stop on."""
    path = tmp_path / "a.jsonl"
    path.write_bytes(jsonl_bytes(DOCS) + b"[1]\n")
    skip = prepare_cache(data_config(tmp_path, dataset=str(path), on_bad_record="skip"))
    assert skip.built
    with pytest.raises(DatasetError) as caught:
        prepare_cache(data_config(tmp_path, dataset=str(path)))
    assert str(caught.value).startswith(f"dataset cache {skip.key} was built with data.on_bad_record=skip and lacks bad records")


def test_corrupt_row_group_is_skipped_whole_and_the_next_one_read(tmp_path):
    path = tmp_path / "page.parquet"
    _corrupt_page(path)
    info = prepare_cache(data_config(tmp_path, dataset=str(path), num_samples=0, on_bad_record="skip"))
    cache = open_cache(info.path)
    assert np.concatenate([cache.tokens("train"), cache.tokens("val")]).tolist() == byte_stream(DOCS[:16] + DOCS[32:])
    assert cache.meta["dataset"]["skipped"]["records"] == 16
    assert cache.meta["dataset"]["documents"] == len(DOCS) - 16
