#!/usr/bin/env python3
"""Build (or check) the dataset cache without training: `gpuherd prepare` (dataset_cache/cli.py).

    python3 prepare_dataset.py [--debug | --preset P | --config F | --set data.KEY=V ...]
    python3 prepare_dataset.py --verify-cache      # also checksum every byte of an existing cache
    python3 prepare_dataset.py --list              # caches under data.cache_dir with their size
    python3 prepare_dataset.py --clean [KEY|raw]   # remove all caches, one, or the downloaded text
    python3 prepare_dataset.py --workers N         # tokenizer processes (default: every core)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runnable from any directory

from gpuherd.extras import extras_named  # noqa: E402

if __name__ == "__main__":
    with extras_named("prepare_dataset.py"):
        from dataset_cache.cli import main

        sys.exit(main(prog="prepare_dataset.py"))
