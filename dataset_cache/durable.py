"""Writing files that must survive a crash whole or not at all.

A cache directory becomes visible only by `rename`, after every file in it and
the directory itself were fsynced, so a reader never sees a half-written cache
and a power loss cannot leave a renamed directory with empty files in it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from gpuherd.files import fsync_dir


def publish_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a fully written, fsynced temp directory into its final place."""
    fsync_dir(tmp_dir)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def remove_tree(path: Path) -> None:
    """Delete a directory so that no reader can ever find it half deleted: it is
    first renamed to a hidden name (atomic), then removed at leisure."""
    if not path.exists():
        return
    doomed = path.with_name(f".trash-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


@contextlib.contextmanager
def temp_dir_beside(final_dir: Path, prefix: str) -> Iterator[Path]:
    """A temp directory on the same filesystem as `final_dir` (so rename is atomic),
    removed again unless the caller renamed it away."""
    tmp = final_dir.parent / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
