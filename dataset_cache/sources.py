"""data.dataset -> a Corpus: the built-in names first, else a path."""

from __future__ import annotations

from pathlib import Path

from dataset_cache.corpus import Corpus, local_corpus
from dataset_cache.dummy import DummyCorpus
from dataset_cache.shakespeare import shakespeare_corpus


def open_corpus(dataset: str, num_samples: int, cache_dir: Path) -> Corpus:
    if dataset == "shakespeare":
        return shakespeare_corpus(cache_dir)
    if dataset == "dummy":
        return DummyCorpus(num_samples)
    return local_corpus(dataset)
