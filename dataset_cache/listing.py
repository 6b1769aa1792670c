"""What `prepare_dataset.py --list` shows and `--clean` removes."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dataset_cache.build import temp_prefix
from dataset_cache.cache import read_metadata
from dataset_cache.durable import remove_tree
from dataset_cache.hash_memo import memo_dir
from dataset_cache.locking import lock_path, release, try_lock
from dataset_cache.mixture import MIXTURE_FILE, open_mixture
from gpuherd.errors import CacheCorruptError, DatasetError

KEY_DIR = re.compile(r"^[0-9a-f]{16}$")
RAW_DIR = "raw"


@dataclass(frozen=True)
class CacheEntry:
    key: str
    path: Path
    size_bytes: int
    summary: str  # dataset, tokenizer and token counts (a mixture: its sources' shares), or what is wrong with it


def list_caches(cache_dir: Path) -> list[CacheEntry]:
    if not cache_dir.is_dir():
        return []
    entries = []
    for path in sorted(p for p in cache_dir.iterdir() if p.is_dir() and KEY_DIR.match(p.name)):
        entries.append(CacheEntry(path.name, path, tree_size(path), _summary(path)))
    raw = cache_dir / RAW_DIR
    if raw.is_dir():
        for path in sorted(p for p in raw.iterdir() if p.is_dir() and not p.name.startswith(".")):
            entries.append(CacheEntry(f"{RAW_DIR}/{path.name}", path, tree_size(path), "downloaded raw text"))
    return entries


def clean_caches(cache_dir: Path, which: str) -> list[CacheEntry]:
    """Remove caches: `all` (every token cache and leftover temp dir), `raw`
    (downloaded corpora), or one key (a unique prefix is enough). A cache that a
    builder is writing right now is skipped with an error, never pulled from under it."""
    entries = [e for e in list_caches(cache_dir) if not e.key.startswith(f"{RAW_DIR}/")]
    if which == "raw":
        targets = [e for e in list_caches(cache_dir) if e.key.startswith(f"{RAW_DIR}/")]
    elif which == "all":
        targets = entries
    else:
        targets = [e for e in entries if e.key.startswith(which)]
        if len(targets) != 1:
            known = ", ".join(e.key for e in entries) or "none"
            what = "no cache" if not targets else f"{len(targets)} caches"
            raise DatasetError(f"{what} in {cache_dir} match '{which}' (caches: {known})")
    removed = []
    for entry in targets:
        # The same lock names the builders take: "<key>" and "raw-<corpus>".
        fd = try_lock(lock_path(cache_dir, entry.key.replace("/", "-")))
        if fd is None:
            raise DatasetError(f"dataset cache {entry.key} is being built by another process right now; not removed")
        try:
            remove_tree(entry.path)
        finally:
            release(fd)
        removed.append(entry)
    if which == "all":
        _remove_unlocked_leftovers(cache_dir)
        shutil.rmtree(memo_dir(cache_dir), ignore_errors=True)  # remembered raw-text hashes
    return removed


def tree_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def format_size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1000
    return f"{size:,.1f} TB"


def _summary(path: Path) -> str:
    if (path / MIXTURE_FILE).is_file():
        return _mixture_summary(path)
    try:
        meta = read_metadata(path)
        tokens = meta["tokens"]
        return (
            f"{meta['dataset']['name']} | {meta['tokenizer']['name']} | "
            f"{tokens['train']:,} train + {tokens['val']:,} val tokens | {meta['build']['created']}"
        )
    except (CacheCorruptError, KeyError, TypeError) as exc:
        return f"DAMAGED: {exc}"


def _mixture_summary(path: Path) -> str:
    try:
        mixture = open_mixture(path)
    except DatasetError as exc:  # a source cache removed or damaged since
        return f"DAMAGED: {exc}"
    parts = [f"{Path(s.spec).name or s.spec} {s.train_share:.1%}" for s in mixture.sources if s.train_share > 0]
    held_out = sum(1 for s in mixture.sources if s.role == "held_out")
    return f"mixture: {' + '.join(parts)}{f' (+ {held_out} held out)' if held_out else ''} | {mixture.tokenizer}"


def _remove_unlocked_leftovers(cache_dir: Path) -> None:
    """Temp dirs of builds whose builder is gone (its key lock is free)."""
    for leftover in cache_dir.glob(f"{temp_prefix('*')}-*"):
        short_key = leftover.name.split("-")[1]
        fd = try_lock(lock_path(cache_dir, short_key))
        if fd is None:
            continue  # a live build
        try:
            shutil.rmtree(leftover, ignore_errors=True)
        finally:
            release(fd)
