"""Crash-safe files and non-blocking locks, one implementation for every part.

The project's rule is that caches, checkpoints, configs, summaries and debug
dumps are written atomically: a temp file beside the target, fsync, rename,
fsync the directory, so a reader sees the old file or the new one, never half,
even after a crash or power loss. They get the permissions any other tool would
give them under the user's umask (0644 with the usual 022), so teammates on a shared
cluster can read a run's checkpoints and summaries.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creates, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, read without changing it: `os.umask` can only set it, and
    setting it even for a moment would race with other threads creating files."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no /proc (not Linux): the racy way is the only one left
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Write `path` through the yielded binary handle; it appears only complete.

    The temp name is unique (pid + random), so concurrent writers never share
    one; on any error the temp file is removed and the old `path` is untouched.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes it 0600: private to its owner
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as handle:
        handle.write(data)


def try_flock(fd: int, shared: bool = False) -> bool:
    """Take an flock without waiting: True if taken, False if another holder has it."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def lock_or_close(fd: int) -> int | None:
    """`fd` with its exclusive flock taken without waiting, or None (and `fd` closed) when
    another holder has it; on any other error `fd` is closed too. For lock files whose
    descriptor is the lock: the caller keeps it for as long as it holds the lock."""
    try:
        taken = try_flock(fd)
    except OSError:
        os.close(fd)
        raise
    if not taken:
        os.close(fd)
        return None
    return fd
