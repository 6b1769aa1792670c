#!/usr/bin/env python3
"""Build (or check) the dataset cache without training.

    python3 prepare_dataset.py [--debug | --preset P | --config F | --set data.KEY=V ...]
    python3 prepare_dataset.py --verify-cache      # also checksum every byte of an existing cache
    python3 prepare_dataset.py --list              # caches under data.cache_dir with their size
    python3 prepare_dataset.py --clean [KEY|raw]   # remove all caches, one, or the downloaded text
    python3 prepare_dataset.py --workers N         # tokenizer processes (default: every core)

Prints the key, path, token counts and time. Errors are one line: exit 3 for
the dataset (not fetchable, unreadable, corrupt beyond rebuilding), 2 for usage.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runnable from any directory

from loguru import logger  # noqa: E402

from gpuherd.cli import base_parser, config_from_args, die  # noqa: E402
from gpuherd.exit_codes import ExitCode  # noqa: E402

PROG = "prepare_dataset.py"


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(PROG, "Tokenize the configured dataset once into the hash-keyed cache.")
    action = parser.add_argument_group("actions (default: build or reuse the cache)")
    action.add_argument("--verify-cache", action="store_true", help="checksum every file of an existing cache (sizes are always checked)")
    action.add_argument("--list", action="store_true", help="list the caches under data.cache_dir with their size")
    action.add_argument(
        "--clean", nargs="?", const="all", default=None, metavar="KEY",
        help="remove every cache (no KEY), one cache (a key or unique prefix), or 'raw' (downloaded text)",
    )
    action.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizer processes (default: every core for corpora over 4 MB, else 1)")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        die(f"--workers must be >= 1, got {args.workers}", prog=PROG)
    if sum([args.list, args.clean is not None, args.verify_cache]) > 1:
        die("--list, --clean and --verify-cache are separate actions; give one", prog=PROG)
    cfg = config_from_args(args)
    logger.remove()
    logger.add(sys.stderr, level=cfg.debug.log_level, format="{level} | {message}")

    from dataset_cache import DatasetError
    from dataset_cache.listing import clean_caches, format_size, list_caches

    cache_dir = Path(cfg.data.cache_dir)
    try:
        if args.list:
            entries = list_caches(cache_dir)
            print(f"{len(entries)} cache{'s' if len(entries) != 1 else ''} in {cache_dir}, "
                  f"{format_size(sum(e.size_bytes for e in entries))} in all")
            for entry in entries:
                print(f"{entry.key:<24} {format_size(entry.size_bytes):>10}  {entry.summary}")
            return ExitCode.OK
        if args.clean is not None:
            removed = clean_caches(cache_dir, args.clean)
            freed = sum(e.size_bytes for e in removed)
            print(f"removed {len(removed)} cache{'s' if len(removed) != 1 else ''} from {cache_dir}, freed {format_size(freed)}")
            return ExitCode.OK
        return _prepare(cfg, verify=True if args.verify_cache else None, workers=args.workers)
    except DatasetError as exc:
        die(str(exc), code=ExitCode.DATA, prog=PROG)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no partial cache was published", file=sys.stderr)
        return ExitCode.SIGINT


def _prepare(cfg, verify: bool | None, workers: int | None) -> int:  # noqa: ANN001 (gpuherd.config.Config)
    from dataset_cache import TokenCache, open_data, prepare_cache

    info = prepare_cache(cfg.data, verify=verify, workers=workers)
    data = open_data(info.path)
    checked = "checksums" if (verify or cfg.data.verify_cache or info.built) else "sizes"
    print(f"key:       {info.key}")
    print(f"path:      {info.path}")
    if isinstance(data, TokenCache):
        meta = data.meta
        print(f"dataset:   {meta['dataset']['name']} ({meta['dataset']['documents']:,} documents)")
        skipped = meta["dataset"].get("skipped") or {}
        if skipped.get("records") or skipped.get("lost_tails"):
            print(f"skipped:   {skipped['records']:,} bad records, {skipped['lost_tails']} undecodable file tails "
                  f"(first: {skipped['first']})")
        print(f"tokenizer: {meta['tokenizer']['name']} (vocab {data.vocab_size:,}, {meta['dtype']})")
    else:
        print(f"mixture:   {len(data.sources)} sources, tokenizer {data.tokenizer} (vocab {data.vocab_size:,})")
        for line in info.sources:
            print(f"  {line}")
    print(f"tokens:    {info.train_tokens + info.val_tokens:,} ({info.train_tokens:,} train + {info.val_tokens:,} val)")
    print(f"status:    {'built' if info.built else 'reused'}, {checked} verified, in {info.seconds:.2f} s")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
