"""Turns text into a verified, hash-keyed token cache that every worker memory-maps.

Public API (the supervisor, the worker and generate.py use only these names):

    prepare_cache(data, *, verify=None) -> CacheInfo   build once (locked) or reuse + verify;
                                                       data.mix: one cache per source + a manifest
    open_cache(path, verify=False) -> TokenCache       size checks always, checksums on verify
    open_data(path, verify=False) -> TokenCache | Mixture   what CacheInfo.path names
    TokenCache.tokens("train" | "val") -> np.memmap    read-only
    BatchSampler(cache, split, batch_size, context_length, rank, world_size, seed)
    MixtureSampler(mixture, split, ...)                the same protocol over a mixture
    describe_data(cache_or_mixture, planned_tokens)    the run's start-up line
    load_tokenizer(spec) -> Tokenizer                  "gpt2", "byte" or a tokenizer.json path
    padded_vocab_size(vocab_size, multiple=64)
    DatasetError                                       one line; entry points exit 3
"""

from dataset_cache.cache import TokenCache, open_cache
from dataset_cache.mixture import Mixture, open_data
from dataset_cache.mixture_sampler import MixtureSampler
from dataset_cache.prepare import CacheInfo, prepare_cache
from dataset_cache.sampler import BatchSampler
from dataset_cache.summary import describe_data
from dataset_cache.tokenizers import Tokenizer, load_tokenizer, padded_vocab_size
from gpuherd.errors import CacheCorruptError, DatasetError

__all__ = [
    "BatchSampler", "CacheCorruptError", "CacheInfo", "DatasetError", "Mixture", "MixtureSampler", "TokenCache",
    "Tokenizer", "describe_data", "load_tokenizer", "open_cache", "open_data", "padded_vocab_size", "prepare_cache",
]
