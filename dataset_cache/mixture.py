"""A weighted mixture of sources (data.mix), each tokenized into its own cache.

Every source gets an ordinary cache keyed by its own content, tokenizer and
text field, so a source shared by two mixtures is tokenized once and a changed
weight rebuilds nothing. The mixture itself is a manifest,
`<cache_dir>/<key>/mixture.json`, keyed by the sources' cache keys, the token
ranges read and the shares: it names the source caches (relative to cache_dir,
so the whole cache_dir can move) and the share of windows each one gets.
Workers are handed the manifest's directory and sample it with MixtureSampler.

Shares of the training windows (every window is context_length + 1 tokens, so
these are shares of the training tokens too):
  weight  w_s -> w_s / sum(w)
  epochs  e_s -> e_s * tokens_s / sum(e * tokens): every source reaches its
          epoch count at the same moment
Validation: each training source's val split, mixed with the training shares;
or, with `held_out: true` sources, those sources (all their tokens, shares by
size) while the training sources are read whole (their val split trains too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from dataset_cache.cache import ALL, TokenCache, open_cache
from dataset_cache.hashing import canonical_json, sha256_bytes
from dataset_cache.key import SHORT_KEY_CHARS
from gpuherd.errors import CacheCorruptError, DatasetError
from gpuherd.files import write_bytes_atomic

MIXTURE_FILE = "mixture.json"
MIXTURE_FORMAT = 1


@dataclass(frozen=True)
class MixtureSource:
    spec: str  # as configured (data.mix[i].source)
    role: str  # weight | epochs | held_out
    amount: float  # the configured weight or epoch count (1 when held out)
    cache: TokenCache
    train_range: str | None  # "train", "all" or None (held out)
    val_range: str | None  # "val", "all" or None (trained on only)
    train_share: float
    val_share: float

    def tokens(self, split: str) -> int:
        which = self.train_range if split == "train" else self.val_range
        return 0 if which is None else int(self.cache.tokens(which).size)


class Mixture:
    """An opened manifest: every source cache checked (sizes, or checksums on verify)."""

    def __init__(self, path: Path, meta: dict[str, Any], sources: list[MixtureSource]) -> None:
        self.path, self.meta, self.sources = path, meta, sources
        self.key: str = path.name
        first = sources[0].cache
        self.vocab_size, self.tokenizer, self.eot_id = first.vocab_size, first.tokenizer, first.eot_id

    def parts(self, split: str) -> list[MixtureSource]:
        """The sources this split reads, in manifest order."""
        share = (lambda s: s.train_share) if split == "train" else (lambda s: s.val_share)
        return [s for s in self.sources if share(s) > 0]

    def tokens(self, split: str) -> int:
        return sum(s.tokens(split) for s in self.sources)


def write_mixture(cache_dir: Path, entries: list[dict[str, Any]], caches: list[TokenCache]) -> Path:
    """The manifest for data.mix `entries` over their built `caches`; rewritten only if it differs."""
    _check_distinct(entries, caches)
    held_out = any("held_out" in e for e in entries)
    rows = []
    for entry, cache in zip(entries, caches, strict=True):
        role = next(r for r in ("weight", "epochs", "held_out") if r in entry)
        train_range = None if role == "held_out" else (ALL if held_out else "train")
        val_range = ALL if role == "held_out" else (None if held_out else "val")
        amount = 1.0 if role == "held_out" else float(entry[role])
        rows.append({"spec": entry["source"], "role": role, "amount": amount, "cache": cache.key,
                     "key": cache.meta["key"], "train_range": train_range, "val_range": val_range})
    _assign_shares(rows, caches, held_out)
    key_inputs = {"format": MIXTURE_FORMAT, "sources": [
        {name: row[name] for name in ("key", "train_range", "val_range", "train_share", "val_share")} for row in rows
    ]}
    digest = sha256_bytes(canonical_json(key_inputs))
    manifest = {"format_version": MIXTURE_FORMAT, "kind": "mixture", "key": digest, "key_inputs": key_inputs,
                "tokenizer": caches[0].meta["tokenizer"], "held_out": held_out, "sources": rows}
    path = cache_dir / digest[:SHORT_KEY_CHARS]
    data = canonical_json(manifest)
    target = path / MIXTURE_FILE
    if not (target.is_file() and target.read_bytes() == data):
        path.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(target, data)
    return path


def _check_distinct(entries: list[dict[str, Any]], caches: list[TokenCache]) -> None:
    seen: dict[str, str] = {}
    for entry, cache in zip(entries, caches, strict=True):
        if cache.key in seen:
            raise DatasetError(
                f"data.mix sources {seen[cache.key]} and {entry['source']} hold the same data (cache {cache.key}); list it once"
            )
        seen[cache.key] = entry["source"]
    if len({cache.tokenizer for cache in caches}) > 1:
        raise DatasetError("data.mix source caches were built with different tokenizers")


def _assign_shares(rows: list[dict[str, Any]], caches: list[TokenCache], held_out: bool) -> None:
    train_mass, val_mass = [], []
    for row, cache in zip(rows, caches, strict=True):
        train = 0.0
        if row["train_range"]:
            passes = row["role"] == "epochs"
            train = row["amount"] * (cache.tokens(row["train_range"]).size if passes else 1.0)
        train_mass.append(float(train))
        val_mass.append(float(cache.tokens(row["val_range"]).size if row["val_range"] else 0) if held_out else train)
    for row, train, val in zip(rows, _normalized(train_mass), _normalized(val_mass), strict=True):
        row["train_share"], row["val_share"] = train, val


def _normalized(values: list[float]) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def open_data(path: Path, verify: bool = False) -> TokenCache | Mixture:
    """What GPUHERD_DATASET_CACHE names: one cache, or a mixture manifest's directory."""
    path = Path(path)
    return open_mixture(path, verify) if (path / MIXTURE_FILE).is_file() else open_cache(path, verify)


def open_mixture(path: Path, verify: bool = False) -> Mixture:
    try:
        meta = orjson.loads((path / MIXTURE_FILE).read_bytes())
        if meta["format_version"] != MIXTURE_FORMAT:
            raise CacheCorruptError(f"dataset mixture {path} has format {meta['format_version']}, this gpuherd reads {MIXTURE_FORMAT}")
        rows = meta["sources"]
        sources = [_open_source(path, row, verify) for row in rows]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise CacheCorruptError(f"dataset mixture {path}: unreadable {MIXTURE_FILE} ({type(exc).__name__}: {exc})") from None
    if not sources:
        raise CacheCorruptError(f"dataset mixture {path} lists no sources")
    return Mixture(path, meta, sources)


def _open_source(path: Path, row: dict[str, Any], verify: bool) -> MixtureSource:
    cache = open_cache(path.parent / row["cache"], verify=verify)
    if cache.meta.get("key") != row["key"]:
        raise CacheCorruptError(f"dataset mixture {path}: source cache {row['cache']} holds other data than it names")
    return MixtureSource(
        spec=row["spec"], role=row["role"], amount=float(row["amount"]), cache=cache, train_range=row["train_range"],
        val_range=row["val_range"], train_share=float(row["train_share"]), val_share=float(row["val_share"]),
    )
