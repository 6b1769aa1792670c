"""An exclusive, crash-safe lock per cache key (fcntl.flock on a lock file).

flock is released by the kernel when its holder dies, even by SIGKILL, so a
crashed builder never leaves a stale lock behind. Lock files are never deleted:
unlinking a lock file while another process waits on it would let a third
process lock a new file of the same name and build concurrently.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

from loguru import logger

from gpuherd.files import lock_or_close, try_flock

POLL_SECONDS = 0.05
REPORT_EVERY_SECONDS = 10.0


def lock_path(cache_dir: Path, name: str) -> Path:
    return cache_dir / ".locks" / f"{name}.lock"


@contextlib.contextmanager
def exclusive_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on `path`; while waiting, say who holds it and for what."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, what)
        # The holder's pid, only for the "waiting for ..." message of others.
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def try_lock(path: Path) -> int | None:
    """Take the lock without waiting: a descriptor to pass to `release`, or None if held."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return lock_or_close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))


def release(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _acquire(fd: int, path: Path, what: str) -> None:
    # Poll instead of a blocking flock so the wait is visible and Ctrl-C works promptly.
    started = time.monotonic()
    next_report = 0.0
    while True:
        if try_flock(fd):
            return
        waited = time.monotonic() - started
        if waited >= next_report:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            logger.info(f"waiting for process {holder} to finish {what} (lock {path}, {waited:.0f} s so far)")
            next_report = waited + REPORT_EVERY_SECONDS
        time.sleep(POLL_SECONDS)
