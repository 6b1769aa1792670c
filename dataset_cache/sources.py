"""data.dataset -> a Corpus: the built-in names first, else a path."""

from __future__ import annotations

from pathlib import Path

from dataset_cache.corpus import Corpus, local_corpus
from dataset_cache.dummy import DummyCorpus
from dataset_cache.hash_memo import HashMemo, memo_dir
from dataset_cache.shakespeare import shakespeare_corpus


def open_corpus(dataset: str, num_samples: int, cache_dir: Path, trust_hash_memo: bool = True) -> Corpus:
    """trust_hash_memo=False (--verify-cache) re-reads every raw file for the key."""
    if dataset == "shakespeare":
        return shakespeare_corpus(cache_dir)
    if dataset == "dummy":
        return DummyCorpus(num_samples)
    return local_corpus(dataset, HashMemo(memo_dir(cache_dir), trust=trust_hash_memo))
