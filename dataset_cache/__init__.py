"""Turns text into a verified, hash-keyed token cache that every worker memory-maps.

Public API (the supervisor, the worker and generate.py use only these names):

    prepare_cache(data, *, verify=None) -> CacheInfo   build once (locked) or reuse + verify
    open_cache(path, verify=False) -> TokenCache       size checks always, checksums on verify
    TokenCache.tokens("train" | "val") -> np.memmap    read-only
    BatchSampler(cache, split, batch_size, context_length, rank, world_size, seed)
    load_tokenizer(spec) -> Tokenizer                  "gpt2", "byte" or a tokenizer.json path
    padded_vocab_size(vocab_size, multiple=64)
    DatasetError                                       one line; entry points exit 3
"""

from dataset_cache.cache import TokenCache, open_cache
from dataset_cache.errors import CacheCorruptError, DatasetError
from dataset_cache.prepare import CacheInfo, prepare_cache
from dataset_cache.sampler import BatchSampler
from dataset_cache.tokenizers import Tokenizer, load_tokenizer, padded_vocab_size

__all__ = [
    "BatchSampler", "CacheCorruptError", "CacheInfo", "DatasetError", "TokenCache", "Tokenizer",
    "load_tokenizer", "open_cache", "padded_vocab_size", "prepare_cache",
]
