"""Crash-safe files and non-blocking locks, one implementation for every part.

The project's rule is that caches, checkpoints, configs, summaries and debug
dumps are written atomically: a temp file beside the target, fsync, rename,
fsync the directory, so a reader sees the old file or the new one, never half,
even after a crash or power loss.

A temp file is created with mode 0666 minus the user's umask, like any file a
tool writes (teammates read checkpoints on shared clusters), and its writer holds
an flock on it until the rename: a temp file nobody holds is a dead writer's
leftover (`held_by_nobody`), safe to remove.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creates, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path, label: str = "", before_publish: Callable[[], None] | None = None) -> Iterator[BinaryIO]:
    """Write `path` through the yielded binary handle; it appears only complete.

    The temp file `.<name>.[<label>.]<pid>.<random>.tmp` is unique, so concurrent
    writers never share one, and says who left it; on any error it is removed and
    the old `path` is untouched. `before_publish` runs once the bytes are durable and
    before the rename (a checkpoint's manifest: the file never shows without it).
    """
    fd, tmp = _create_temp(path, label)
    try:
        with os.fdopen(fd, "wb") as handle:
            _hold(handle.fileno())
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
            if before_publish is not None:
                before_publish()
            os.replace(tmp, path)  # still locked: the name never shows an unheld temp file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _create_temp(path: Path, label: str) -> tuple[int, Path]:
    """O_EXCL with mode 0666, so the kernel applies the umask (and default ACLs), which
    tempfile.mkstemp's fixed 0600 would override."""
    while True:
        tmp = _temp_name(path, label)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue


def _hold(fd: int) -> None:
    """Mark a temp file or directory as a live writer's (see held_by_nobody). Best effort:
    where the filesystem has no flock (Lustre without `-o flock`) saving must still work;
    its leftovers are then never judged orphaned, since no live writer can be told apart."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        pass


def _temp_name(path: Path, label: str) -> Path:
    return path.with_name(f".{path.name}.{label + '.' if label else ''}{os.getpid()}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def locked_temp_dir(path: Path, label: str = "") -> Iterator[Path]:
    """A temp directory beside `path`, named like atomic_file's temp files and flock-held
    while the caller fills it and renames it into place; removed if the caller raises."""
    tmp = _temp_name(path, label)
    tmp.mkdir()
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _hold(fd)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(fd)


def open_log(path: Path) -> int:
    """A log file's fd for appending, never through a symbolic link (O_NOFOLLOW: a link planted
    at `path` is an OSError, ELOOP, instead of a write into whatever it points at)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)


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


def held_by_nobody(path: Path) -> bool:
    """True when no live process holds `path`'s flock (a temp file or directory whose
    writer died). False when one does, or when the filesystem cannot tell: keep it then."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return try_flock(fd)
    except OSError:  # no flock on this filesystem: nobody can be proven gone
        return False
    finally:
        os.close(fd)  # drops the lock we may have taken
