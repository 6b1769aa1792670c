"""The cache key changes with every input that decides the cache's bytes, and
with nothing else."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from tests.dataset_cache.helpers import PYTHON, ROOT, data_config

from dataset_cache import prepare_cache
from dataset_cache.key import FORMAT_VERSION, cache_key, key_inputs
from dataset_cache.sources import open_corpus
from dataset_cache.tokenizers import load_tokenizer


def key_of(cfg) -> str:
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = open_corpus(cfg.dataset, cfg.num_samples, Path(cfg.cache_dir))
    return cache_key(key_inputs(tokenizer, corpus, cfg.context_length, cfg.num_samples, cfg.val_fraction)).digest


def write_tokenizer_json(path: Path, extra_word: str = "") -> Path:
    """A tiny WordLevel tokenizer.json with an end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, "hello": 2, "world": 3}
    if extra_word:
        vocab[extra_word] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_key_inputs_are_exactly_the_documented_ones(tmp_path):
    cfg = data_config(tmp_path)
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = open_corpus(cfg.dataset, cfg.num_samples, Path(cfg.cache_dir))
    inputs = key_inputs(tokenizer, corpus, cfg.context_length, cfg.num_samples, cfg.val_fraction)
    assert inputs == {
        "format": FORMAT_VERSION,
        "tokenizer": {"name": "byte", "sha256": tokenizer.fingerprint},
        "dataset": {"name": "dummy-v1", "sha256": corpus.fingerprint()},
        "context_length": 32, "num_samples": 200, "dtype": "uint16", "val_fraction": 0.1,
    }


def test_key_is_stable_across_processes(tmp_path):
    """No hash randomization or dict order leaks into the key."""
    cfg = data_config(tmp_path)
    script = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
        "from gpuherd.config import DataConfig; from dataset_cache.key import cache_key, key_inputs;"
        "from dataset_cache.sources import open_corpus; from dataset_cache.tokenizers import load_tokenizer;"
        "c = DataConfig(**json.loads(sys.argv[2]));"
        "print(cache_key(key_inputs(load_tokenizer(c.tokenizer), open_corpus(c.dataset, c.num_samples, Path(c.cache_dir)),"
        " c.context_length, c.num_samples, c.val_fraction)).digest)"
    )
    keys = {
        subprocess.run([PYTHON, "-c", script, str(ROOT), json.dumps(cfg.__dict__)], capture_output=True,
                       text=True, check=True, env={"PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2")
    }
    assert keys == {key_of(cfg)}


@pytest.mark.parametrize(
    "change",
    [
        {"tokenizer": "gpt2"},
        {"context_length": 64},
        {"num_samples": 201},
        {"val_fraction": 0.2},
        {"dataset": "LOCAL"},
    ],
    ids=["tokenizer", "context_length", "num_samples", "val_fraction", "dataset"],
)
def test_each_input_changes_the_key(tmp_path, change):
    base = data_config(tmp_path)
    if change.get("dataset") == "LOCAL":
        (tmp_path / "a.txt").write_text("some text\n")
        change = {"dataset": str(tmp_path / "a.txt")}
    assert key_of(base) != key_of(dataclasses.replace(base, **change))


def test_changed_raw_text_changes_the_key(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("To be, or not to be.\n")
    (corpus / "b.txt").write_text("That is the question.\n")
    cfg = data_config(tmp_path, dataset=str(corpus))
    before = key_of(cfg)
    assert key_of(cfg) == before
    (corpus / "b.txt").write_text("That is the questioN.\n")  # one byte
    assert key_of(cfg) != before
    (corpus / "b.txt").write_text("That is the question.\n")
    assert key_of(cfg) == before
    (corpus / "b.txt").rename(corpus / "c.txt")  # same bytes, another document name
    assert key_of(cfg) != before


def test_changed_vocabulary_file_changes_the_key(tmp_path):
    """The anchor bug (axolotl #33/#885): same tokenizer name, new vocabulary."""
    path = write_tokenizer_json(tmp_path / "tokenizer.json")
    cfg = data_config(tmp_path, tokenizer=str(path))
    before = key_of(cfg)
    write_tokenizer_json(path, extra_word="extra")
    assert key_of(cfg) != before


def test_dtype_follows_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000}
    path = tmp_path / "big" / "tokenizer.json"
    path.parent.mkdir()
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(path))
    cfg = data_config(tmp_path, tokenizer=str(path))
    tokenizer = load_tokenizer(cfg.tokenizer)
    corpus = open_corpus(cfg.dataset, cfg.num_samples, Path(cfg.cache_dir))
    assert key_inputs(tokenizer, corpus, 32, 200, 0.1)["dtype"] == "uint32"


def test_irrelevant_settings_keep_the_key(tmp_path):
    """cache_dir and verify_cache decide where and how, not what: same key, and a
    second prepare in the same directory reuses."""
    a = prepare_cache(data_config(tmp_path))
    b = prepare_cache(data_config(tmp_path, verify_cache=True))
    c = prepare_cache(data_config(tmp_path, cache_dir=str(tmp_path / "elsewhere")))
    assert a.key == b.key == c.key
    assert a.built and not b.built and c.built


def test_hash_memo_is_trusted_only_while_the_file_is_untouched(tmp_path, monkeypatch):
    """Big corpora are not re-hashed on every start, yet an in-place rewrite that
    even restores size and mtime still changes the key (ctime moves)."""
    import os

    from dataset_cache import hash_memo

    monkeypatch.setattr(hash_memo, "MEMO_MIN_BYTES", 0)
    path = tmp_path / "big.txt"
    path.write_text("original text\n")
    cfg = data_config(tmp_path, dataset=str(path))
    before = key_of(cfg)
    (memo_file,) = (tmp_path / "cache" / ".hashes").iterdir()
    memo = json.loads(memo_file.read_text())
    memo["sha256"] = "0" * 64  # proves the memo is what answers while the file is untouched
    memo_file.write_text(json.dumps(memo))
    remembered = key_of(cfg)
    assert remembered != before
    stat = path.stat()
    path.write_text("Original text\n")  # same size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime
    rewritten = key_of(cfg)
    assert rewritten not in (before, remembered)
    path.write_text("original text\n")
    assert key_of(cfg) == before
