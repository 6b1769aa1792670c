"""Keys stay honest for record formats: content, text field, reader version and
tokenizer change the key; the corpus's location and on_bad_record do not."""

from __future__ import annotations

import pytest

from dataset_cache import prepare_cache, readers
from tests.dataset_cache.corpora import documents, jsonl_bytes, write_corpus
from tests.dataset_cache.helpers import data_config

DOCS = documents(60)


def prepare(tmp_path, dataset, **overrides):
    return prepare_cache(data_config(tmp_path, dataset=str(dataset), num_samples=0, **overrides))


def test_inputs_of_a_parquet_corpus(tmp_path):
    from dataset_cache.key import key_inputs
    from dataset_cache.sources import open_corpus
    from dataset_cache.tokenizers import load_tokenizer

    path = write_corpus(tmp_path / "c", "parquet", DOCS)
    corpus = open_corpus(str(path), 0, tmp_path / "cache", text_field="body")
    dataset = key_inputs(load_tokenizer("byte"), corpus, 32, 0, 0.1)["dataset"]
    assert dataset == {"sha256": corpus.fingerprint(), "readers": {"parquet": 1}, "text_field": "body"}


def test_moving_the_corpus_keeps_the_cache(tmp_path):
    before = prepare(tmp_path, write_corpus(tmp_path / "web", "jsonl.zst", DOCS).parent)
    (tmp_path / "web").rename(tmp_path / "web-2024")
    after = prepare(tmp_path, tmp_path / "web-2024")
    assert after.key == before.key and not after.built
    single = prepare(tmp_path, tmp_path / "web-2024" / "corpus.jsonl.zst")
    (tmp_path / "web-2024" / "corpus.jsonl.zst").rename(tmp_path / "renamed.jsonl.zst")
    assert prepare(tmp_path, tmp_path / "renamed.jsonl.zst").key == single.key  # a lone file is keyed by content


def test_text_field_changes_the_key_only_where_it_is_read(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_bytes(jsonl_bytes(DOCS) + jsonl_bytes(DOCS[::-1], field="body"))
    text = prepare(tmp_path, jsonl, on_bad_record="skip")
    body = prepare(tmp_path, jsonl, text_field="body", on_bad_record="skip")
    assert body.key != text.key and body.built
    txt = write_corpus(tmp_path / "plain", "txt", DOCS)
    assert prepare(tmp_path, txt).key == prepare(tmp_path, txt, text_field="body").key


def test_on_bad_record_does_not_change_the_key(tmp_path):
    path = write_corpus(tmp_path / "c", "parquet", DOCS)
    first = prepare(tmp_path, path)
    again = prepare(tmp_path, path, on_bad_record="skip")
    assert again.key == first.key and not again.built


@pytest.mark.parametrize("fmt", ["parquet", "jsonl.gz"])
def test_a_new_reader_version_rebuilds_only_its_format(tmp_path, monkeypatch, fmt):
    path = write_corpus(tmp_path / "c", fmt, DOCS)
    other = write_corpus(tmp_path / "o", "jsonl.zst", DOCS)
    before, other_before = prepare(tmp_path, path).key, prepare(tmp_path, other).key
    monkeypatch.setitem(readers.READER_VERSIONS, fmt, readers.READER_VERSIONS[fmt] + 1)
    assert prepare(tmp_path, path).key != before
    assert prepare(tmp_path, other).key == other_before


def test_tokenizer_and_content_change_the_key(tmp_path):
    path = write_corpus(tmp_path / "c", "parquet", DOCS)
    base = prepare(tmp_path, path).key
    assert prepare(tmp_path, path, tokenizer="gpt2").key != base
    write_corpus(tmp_path / "c", "parquet", DOCS[:-1])
    assert prepare(tmp_path, path).key != base
