"""The cache key: a digest of everything that decides the cache's bytes.

Inputs (canonical JSON, sorted keys): the cache format version, the tokenizer's
name and the sha256 of its vocabulary files, the dataset's identity, context
length, sample count, token dtype, and the validation fraction (the split is
stored in the cache, so it must be keyed too). The dataset's identity is, for
local files, the sha256 of their raw bytes (each named relative to the corpus
root), the version of every format reader used and the text field (unless all
files are plain text); for the built-ins, their name and raw-text sha256.

Anything else (the corpus's location, model, training, cache_dir, verify_cache,
on_bad_record...) leaves the key unchanged, so an unchanged corpus and tokenizer
are always reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dataset_cache.corpus import Corpus
from dataset_cache.hashing import canonical_json, sha256_bytes
from dataset_cache.tokenizers import Tokenizer, token_dtype

FORMAT_VERSION = 1
SHORT_KEY_CHARS = 16  # directory name: 64 bits of the digest, collisions are not a practical concern


@dataclass(frozen=True)
class CacheKey:
    digest: str  # full sha256 hex, recorded in metadata.json
    inputs: dict[str, Any]

    @property
    def short(self) -> str:
        return self.digest[:SHORT_KEY_CHARS]


def key_inputs(
    tokenizer: Tokenizer, corpus: Corpus, context_length: int, num_samples: int, val_fraction: float
) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "tokenizer": {"name": tokenizer.name, "sha256": tokenizer.fingerprint},
        "dataset": corpus.key_inputs(),
        "context_length": int(context_length),
        "num_samples": int(num_samples),
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "val_fraction": float(val_fraction),
    }


def cache_key(inputs: dict[str, Any]) -> CacheKey:
    return CacheKey(digest=sha256_bytes(canonical_json(inputs)), inputs=inputs)
