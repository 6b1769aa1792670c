"""prepare_cache: the one call the supervisor (and pretrain_main.py, and
prepare_dataset.py) makes before any worker starts.

Fast path: compute the key (hashes of the vocabulary files and of the raw text),
open the cache with its size checks, done. Otherwise take the key's exclusive
lock, look again (another process may have built it while we waited), and only
then build. Two supervisors started at the same moment therefore build once and
both use the result.

A mixture (data.mix) prepares every source that way, one cache each, then
writes the small mixture manifest that names them (see mixture.py).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from dataset_cache.build import build_cache, remove_stale_temps
from dataset_cache.cache import TokenCache, open_cache
from dataset_cache.durable import remove_tree
from dataset_cache.key import cache_key, key_inputs
from dataset_cache.locking import exclusive_lock, lock_path
from dataset_cache.mixture import Mixture, open_mixture, write_mixture
from dataset_cache.sources import open_corpus
from dataset_cache.summary import mixture_lines
from dataset_cache.tokenizers import load_tokenizer
from gpuherd.config import DataConfig
from gpuherd.errors import CacheCorruptError, DatasetError


@dataclass
class CacheInfo:
    path: Path  # hand this to workers (GPUHERD_DATASET_CACHE): a cache, or a mixture manifest's directory
    key: str
    built: bool  # False: an existing cache was reused (a mixture: every source cache was)
    train_tokens: int
    val_tokens: int
    seconds: float  # wall time of prepare_cache, build included
    sources: list[str] = field(default_factory=list)  # a mixture: one summary line per source


def prepare_cache(data: DataConfig, *, verify: bool | None = None, workers: int | None = None) -> CacheInfo:
    """Build the cache `data` describes once (locked), or reuse and verify it.

    verify=None follows data.verify_cache; True checksums every file (sizes are
    always checked). `workers` overrides the tokenizer process count (default:
    every core for corpora over a few MB). Raises DatasetError with one line.
    """
    verify = data.verify_cache if verify is None else verify
    try:
        return _prepare_mixture(data, verify, workers) if data.mix is not None else _prepare(data, verify, workers)
    except OSError as exc:  # unwritable or full disk: one line naming the path, not a traceback
        where = exc.filename or data.cache_dir
        raise DatasetError(f"dataset cache {data.cache_dir}: {exc.strerror or exc} ({where})") from None


def _prepare(data: DataConfig, verify: bool, workers: int | None) -> CacheInfo:
    started = time.perf_counter()
    cache_dir = Path(data.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(data.tokenizer)
    corpus = open_corpus(data.dataset, data.num_samples, cache_dir, trust_hash_memo=not verify,
                         text_field=data.text_field, on_bad_record=data.on_bad_record)
    key = cache_key(key_inputs(tokenizer, corpus, data.context_length, data.num_samples, data.val_fraction))
    final_dir = cache_dir / key.short

    cache = _open_if_sound(final_dir, key.digest, verify, report=True)
    built = False
    if cache is None:
        with exclusive_lock(lock_path(cache_dir, key.short), f"building dataset cache {key.short}"):
            cache = _open_if_sound(final_dir, key.digest, verify, report=False)  # built while we waited?
            if cache is None:
                remove_tree(final_dir)  # corrupt or incomplete: never read again
                remove_stale_temps(cache_dir, key.short)
                build_cache(
                    final_dir, key, tokenizer, corpus, context_length=data.context_length,
                    num_samples=data.num_samples, val_fraction=data.val_fraction, workers=workers,
                )
                built = True
                # The first open after a build checks every byte against the checksums.
                cache = open_cache(final_dir, verify=True)
            else:
                logger.info(f"dataset cache {key.short} was built by another process while this one waited")
    seconds = time.perf_counter() - started
    tokens = cache.meta["tokens"]
    _refuse_skipped_records(cache, data)
    if not built:
        logger.info(
            f"reusing dataset cache {key.short} ({tokens['train']:,} train / {tokens['val']:,} val tokens, "
            f"{'checksums' if verify else 'sizes'} verified) in {seconds * 1000:.0f} ms"
        )
    return CacheInfo(
        path=final_dir, key=key.short, built=built, train_tokens=int(tokens["train"]),
        val_tokens=int(tokens["val"]), seconds=seconds,
    )


def _prepare_mixture(data: DataConfig, verify: bool, workers: int | None) -> CacheInfo:
    started = time.perf_counter()
    infos = []
    for entry in data.mix or []:
        source = dataclasses.replace(data, dataset=entry["source"], mix=None,
                                     text_field=entry.get("text_field", data.text_field))
        infos.append(_prepare(source, verify, workers))
    path = write_mixture(Path(data.cache_dir), data.mix or [], [open_cache(info.path) for info in infos])
    mixture: Mixture = open_mixture(path)
    built = any(info.built for info in infos)
    lines = mixture_lines(mixture, [info.built for info in infos])
    logger.info(f"dataset mixture {mixture.key} ({'built' if built else 'reused'}): " + " | ".join(lines))
    return CacheInfo(
        path=path, key=mixture.key, built=built, train_tokens=mixture.tokens("train"),
        val_tokens=mixture.tokens("val"), seconds=time.perf_counter() - started, sources=lines,
    )


def _refuse_skipped_records(cache: TokenCache, data: DataConfig) -> None:
    """A cache built under on_bad_record=skip lacks records that `error` promises to stop on."""
    skipped = cache.meta["dataset"].get("skipped") or {}
    if data.on_bad_record == "error" and (skipped.get("records") or skipped.get("lost_tails")):
        raise DatasetError(
            f"dataset cache {cache.key} was built with data.on_bad_record=skip and lacks bad records "
            f"(first: {skipped.get('first')}); set data.on_bad_record=skip to train on it"
        )


def _open_if_sound(final_dir: Path, digest: str, verify: bool, report: bool) -> TokenCache | None:
    if not final_dir.exists():
        return None
    try:
        cache = open_cache(final_dir, verify=verify)
        if cache.meta.get("key") != digest:  # another cache's files copied or moved here
            raise CacheCorruptError(f"dataset cache {final_dir} holds the cache of key {str(cache.meta.get('key'))[:16]}")
        return cache
    except CacheCorruptError as exc:
        if report:
            logger.warning(f"{exc}; rebuilding it")
        return None
