"""Building caches: exact contents from every kind of source, identical output
whatever the number of processes, the split, the layout, reuse."""

from __future__ import annotations

import numpy as np
import orjson
import psutil
import pytest
from tests.dataset_cache.helpers import data_config

from dataset_cache import DatasetError, load_tokenizer, open_cache, parallel, prepare_cache
from dataset_cache import build as build_module
from dataset_cache.dummy import dummy_document


def byte_stream(*documents: str) -> list[int]:
    """What the byte tokenizer must store: each document's bytes, then eot (0)."""
    return [b for doc in documents for b in [*doc.encode(), 0]]


def all_tokens(cache) -> list[int]:
    return np.concatenate([cache.tokens("train"), cache.tokens("val")]).tolist()


def test_directory_of_text_files(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / ".hidden").mkdir()
    (corpus / "b.txt").write_text("Second document, with ünïcode.\n")
    (corpus / "a.txt").write_text("First document.\nTwo lines.\n")
    (corpus / "sub" / "c.txt").write_text("Third, in a subfolder.\n")
    (corpus / ".hidden" / "d.txt").write_text("never read\n")
    (corpus / "notes.md").write_text("not a .txt file\n")
    info = prepare_cache(data_config(tmp_path, dataset=str(corpus), context_length=4, val_fraction=0.3))
    cache = open_cache(info.path)
    docs = ("First document.\nTwo lines.\n", "Second document, with ünïcode.\n", "Third, in a subfolder.\n")
    assert all_tokens(cache) == byte_stream(*docs)
    offsets = cache.document_offsets().tolist()
    assert offsets == [0, len(byte_stream(docs[0])), len(byte_stream(*docs[:2])), len(byte_stream(*docs))]
    assert cache.meta["dataset"]["documents"] == 3
    assert cache.meta["split_at_document_boundary"] and info.train_tokens in offsets


def test_jsonl_text_field(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "alpha beta gamma delta"}\n\n{"text": "", "id": 2}\n{"text": "epsilon zeta eta", "x": 1}\n')
    cache = open_cache(prepare_cache(data_config(tmp_path, dataset=str(path), context_length=4, val_fraction=0.4)).path)
    assert all_tokens(cache) == byte_stream("alpha beta gamma delta", "epsilon zeta eta")


def test_gpt2_cache_holds_the_tokenizers_ids(tmp_path):
    path = tmp_path / "one.txt"
    text = "".join(dummy_document(i) for i in range(20))
    path.write_text(text)
    info = prepare_cache(data_config(tmp_path, dataset=str(path), tokenizer="gpt2"))
    cache = open_cache(info.path)
    gpt2 = load_tokenizer("gpt2")
    assert all_tokens(cache) == [*gpt2.encode(text), gpt2.eot_id]
    assert (cache.vocab_size, cache.eot_id, cache.tokenizer, cache.dtype) == (50257, 50256, "gpt2", np.uint16)
    assert load_tokenizer(cache.tokenizer).decode(cache.tokens("train")[:5]) == gpt2.decode(gpt2.encode(text)[:5])


def test_parallel_build_is_byte_identical_to_serial(tmp_path, monkeypatch):
    """Two processes, many small batches and a long document cut into pieces:
    the token file must not depend on scheduling."""
    monkeypatch.setattr(parallel, "BATCH_CHARS", 4096)
    monkeypatch.setattr(build_module, "BATCH_CHARS", 4096)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "long.txt").write_text("".join(dummy_document(i) for i in range(60)))  # ~30 KB, one document
    for i in range(30):
        (corpus / f"short{i:02d}.txt").write_text(dummy_document(100 + i))
    built = {}
    for workers in (1, 2):
        cfg = data_config(tmp_path, dataset=str(corpus), tokenizer="gpt2", cache_dir=str(tmp_path / f"c{workers}"))
        info = prepare_cache(cfg, workers=workers)
        built[workers] = (info.path / "tokens.bin").read_bytes(), (info.path / "doc_offsets.bin").read_bytes()
        assert open_cache(info.path).meta["build"]["workers"] == workers
    assert built[1] == built[2]
    assert len(np.frombuffer(built[1][1], dtype=np.uint64)) == 31 + 1


def test_layout_and_metadata(tmp_path):
    info = prepare_cache(data_config(tmp_path))
    assert sorted(p.name for p in info.path.iterdir()) == ["doc_offsets.bin", "metadata.json", "tokens.bin"]
    meta = orjson.loads((info.path / "metadata.json").read_bytes())
    assert meta["key"].startswith(info.key) and meta["key_inputs"]["dataset"]["name"] == "dummy-v1"
    assert meta["tokens"] == {"total": info.train_tokens + info.val_tokens, "train": info.train_tokens, "val": info.val_tokens}
    assert meta["dataset"]["documents"] == 200
    assert abs(info.val_tokens / meta["tokens"]["total"] - 0.1) < 0.02
    assert meta["files"]["tokens.bin"]["bytes"] == 2 * meta["tokens"]["total"]
    assert not any(p.name.startswith(".tmp-") for p in info.path.parent.iterdir())


def test_num_samples_limits_documents(tmp_path):
    small = open_cache(prepare_cache(data_config(tmp_path, num_samples=50)).path)
    large = open_cache(prepare_cache(data_config(tmp_path, num_samples=80)).path)
    assert (small.meta["dataset"]["documents"], large.meta["dataset"]["documents"]) == (50, 80)
    assert all_tokens(large)[: small.total_tokens] == all_tokens(small)  # the first N of one stream


def test_reuse_and_read_only_memmap(tmp_path):
    first = prepare_cache(data_config(tmp_path))
    again = prepare_cache(data_config(tmp_path))
    assert first.built and not again.built and again.path == first.path
    train = open_cache(again.path).tokens("train")
    with pytest.raises(ValueError):
        train[0] = 1
    with pytest.raises(ValueError, match="split"):
        open_cache(again.path).tokens("test")


def test_too_little_text_for_the_context(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words\n")
    with pytest.raises(DatasetError, match="too few for a train and a val split"):
        prepare_cache(data_config(tmp_path, dataset=str(path), context_length=64))
    assert not list((tmp_path / "cache").glob("[0-9a-f]*"))  # nothing published


def test_only_empty_documents(tmp_path):
    corpus = tmp_path / "empty"
    corpus.mkdir()
    (corpus / "a.txt").write_text("")
    with pytest.raises(DatasetError, match="holds no text"):
        prepare_cache(data_config(tmp_path, dataset=str(corpus)))


def test_local_tokenizer_json_build(tmp_path):
    """A tokenizer.json is not splittable: each document is encoded whole, eot from the file."""
    from tests.dataset_cache.test_key import write_tokenizer_json

    tokenizer = write_tokenizer_json(tmp_path / "tokenizer.json")
    path = tmp_path / "data.jsonl"
    path.write_text("".join(f'{{"text": "hello world {i} world hello"}}\n' for i in range(12)))
    cache = open_cache(prepare_cache(data_config(tmp_path, dataset=str(path), tokenizer=str(tokenizer), context_length=8, val_fraction=0.25)).path)
    assert all_tokens(cache) == [2, 3, 1, 3, 2, 0] * 12
    assert (cache.vocab_size, cache.eot_id, cache.tokenizer) == (4, 0, str(tokenizer))


def test_build_with_threads_running_uses_a_clean_forkserver(tmp_path, monkeypatch):
    """A caller with threads (a supervisor's monitor) must not fork: same bytes via forkserver."""
    import threading

    monkeypatch.setattr(parallel, "BATCH_CHARS", 4096)
    monkeypatch.setattr(build_module, "BATCH_CHARS", 4096)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)
    thread.start()
    helpers = parallel._multiprocessing_helpers()
    try:
        threaded = prepare_cache(data_config(tmp_path, cache_dir=str(tmp_path / "a")), workers=2)
    finally:
        stop.set()
        thread.join()
    serial = prepare_cache(data_config(tmp_path, cache_dir=str(tmp_path / "b")), workers=1)
    assert (threaded.path / "tokens.bin").read_bytes() == (serial.path / "tokens.bin").read_bytes()
    # the forkserver and resource tracker the build started end (stopped and reaped) with it
    assert parallel._multiprocessing_helpers() == helpers
    if helpers == (None, None):
        started = [" ".join(p.cmdline()) for p in psutil.Process().children()]
        assert not [c for c in started if "multiprocessing.forkserver" in c or "resource_tracker" in c], started


def test_a_dying_tokenizer_process_fails_the_build_instead_of_hanging(tmp_path, monkeypatch):
    from tests.dataset_cache.helpers import dying_encode_batch

    monkeypatch.setattr(parallel, "BATCH_CHARS", 4096)
    monkeypatch.setattr(parallel, "_encode_batch", dying_encode_batch)
    with pytest.raises(DatasetError, match="a tokenizer process died"):
        prepare_cache(data_config(tmp_path), workers=2)
    assert not list((tmp_path / "cache").glob("[0-9a-f]*")) and not list((tmp_path / "cache").glob(".tmp-*"))
