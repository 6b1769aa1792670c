"""Every input format gives exactly the documents' tokens, in order: files,
directories, globs, compressed JSON Lines, parquet, HF save_to_disk."""

from __future__ import annotations

import numpy as np
import pytest

from dataset_cache import DatasetError, open_cache, prepare_cache
from tests.dataset_cache.corpora import (
    FORMATS,
    byte_stream,
    documents,
    jsonl_bytes,
    write_corpus,
    write_parquet,
    zstd,
)
from tests.dataset_cache.helpers import data_config

DOCS = documents(100)


def all_tokens(info) -> list[int]:
    cache = open_cache(info.path)
    return np.concatenate([cache.tokens("train"), cache.tokens("val")]).tolist()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_holds_exactly_the_documents(tmp_path, fmt):
    dataset = write_corpus(tmp_path / "corpus", fmt, DOCS)
    info = prepare_cache(data_config(tmp_path, dataset=str(dataset), num_samples=0))
    assert all_tokens(info) == byte_stream(DOCS)
    assert open_cache(info.path).meta["dataset"]["documents"] == len(DOCS)


def test_text_field_names_the_column_or_key(tmp_path):
    parquet = write_parquet(tmp_path / "code.parquet", DOCS, field="content")
    jsonl = tmp_path / "code.jsonl"
    jsonl.write_bytes(jsonl_bytes(DOCS, field="content"))
    for path in (parquet, jsonl):
        info = prepare_cache(data_config(tmp_path, dataset=str(path), num_samples=0, text_field="content"))
        assert all_tokens(info) == byte_stream(DOCS)


def test_glob_and_mixed_directory_read_every_format_in_name_order(tmp_path):
    root = tmp_path / "shards"
    parts = [DOCS[:20], DOCS[20:45], DOCS[45:70], DOCS[70:]]
    (root / "sub").mkdir(parents=True)
    write_parquet(root / "a.parquet", parts[0])
    (root / "b.jsonl.zst").write_bytes(zstd(jsonl_bytes(parts[1])))
    (root / "c.jsonl").write_bytes(jsonl_bytes(parts[2]))
    write_parquet(root / "sub" / "d.parquet", parts[3])
    (root / "notes.md").write_text("ignored")
    everything = prepare_cache(data_config(tmp_path, dataset=str(root), num_samples=0))
    assert all_tokens(everything) == byte_stream(DOCS)
    parquet_only = prepare_cache(data_config(tmp_path, dataset=str(root / "**" / "*.parquet"), num_samples=0))
    assert all_tokens(parquet_only) == byte_stream(parts[0] + parts[3])


def test_concatenated_zstd_frames_are_one_stream(tmp_path):
    path = tmp_path / "two-frames.jsonl.zst"
    path.write_bytes(zstd(jsonl_bytes(DOCS[:30])) + zstd(jsonl_bytes(DOCS[30:])))
    assert all_tokens(prepare_cache(data_config(tmp_path, dataset=str(path), num_samples=0))) == byte_stream(DOCS)


def test_gpt2_over_parquet_equals_the_tokenizer_on_the_text(tmp_path):
    """Splittable tokenizers get long records in pieces: still the whole's ids."""
    from dataset_cache import load_tokenizer

    long_docs = ["\n".join(DOCS[i:i + 40]) for i in range(0, 100, 40)]
    path = write_parquet(tmp_path / "long.parquet", long_docs)
    info = prepare_cache(data_config(tmp_path, dataset=str(path), tokenizer="gpt2", num_samples=0, context_length=16))
    gpt2 = load_tokenizer("gpt2")
    assert all_tokens(info) == [t for doc in long_docs for t in [*gpt2.encode(doc), gpt2.eot_id]]


def test_huggingface_save_to_disk_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "hf"
    datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS}).save_to_disk(str(saved), num_shards=3)
    assert all_tokens(prepare_cache(data_config(tmp_path, dataset=str(saved), num_samples=0))) == byte_stream(DOCS)
    shuffled = datasets.load_from_disk(str(saved)).select(range(99, -1, -1))  # an indices mapping, flattened on save
    shuffled.save_to_disk(str(tmp_path / "reversed"))
    reversed_info = prepare_cache(data_config(tmp_path, dataset=str(tmp_path / "reversed"), num_samples=0))
    assert all_tokens(reversed_info) == byte_stream(DOCS[::-1])


def test_huggingface_dataset_dict_asks_for_one_split(tmp_path):
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DatasetError) as caught:
        prepare_cache(data_config(tmp_path, dataset=str(tmp_path / "dd")))
    assert str(caught.value) == (
        f"data.dataset {tmp_path / 'dd'} is a HuggingFace DatasetDict: point it at one split's directory "
        f"(e.g. {tmp_path / 'dd' / 'train'})"
    )


@pytest.mark.parametrize("fmt", ["jsonl.zst", "parquet"])
def test_tokenizer_processes_give_the_same_cache(tmp_path, fmt):
    """The pool forks before pyarrow or zstd open anything; output is identical."""
    dataset = write_corpus(tmp_path / "corpus", fmt, DOCS * 20)
    one = all_tokens(prepare_cache(data_config(tmp_path, dataset=str(dataset), num_samples=0), workers=1))
    two = prepare_cache(data_config(tmp_path, dataset=str(dataset), num_samples=0, cache_dir=str(tmp_path / "c2")), workers=2)
    assert all_tokens(two) == one == byte_stream(DOCS * 20)
