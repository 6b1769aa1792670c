"""data.dataset (or one data.mix source) -> a Corpus: the built-in names first, else files."""

from __future__ import annotations

from pathlib import Path

from dataset_cache.corpus import Corpus, local_corpus
from dataset_cache.dummy import DummyCorpus
from dataset_cache.hash_memo import HashMemo, memo_dir
from dataset_cache.shakespeare import shakespeare_corpus


def open_corpus(dataset: str, num_samples: int, cache_dir: Path, trust_hash_memo: bool = True, *,
                text_field: str = "text", on_bad_record: str = "error") -> Corpus:
    """trust_hash_memo=False (--verify-cache) re-reads every raw file for the key."""
    if dataset == "shakespeare":
        return shakespeare_corpus(cache_dir)
    if dataset == "dummy":
        return DummyCorpus(num_samples)
    memo = HashMemo(memo_dir(cache_dir), trust=trust_hash_memo)
    return local_corpus(dataset, memo, text_field, on_bad_record)
