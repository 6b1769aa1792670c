"""Reading a file a user or a run named, with a bound: never forever, never a device.

`/dev/zero` given as a config file reads forever and fills the memory; a FIFO nobody writes
blocks its reader; a summary.json that is a link to a device or a 100 GB file stalls the view
that reads it. `read_bounded` opens without blocking, looks at what it opened (fstat, not the
name: the name may change between a check and the open), refuses what is not a regular file
(a pipe only when asked for: `--config <(...)`), and reads at most `limit` bytes.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"), (stat.S_ISFIFO, "a named pipe"))
CHUNK = 1 << 20


class NotAFile(OSError):
    """What `path` is instead of a file, in words (`a character device`)."""


class TooLarge(OSError):
    """More than the limit: nothing of it is returned."""


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading when it is a regular file (NotAFile otherwise), without blocking
    on a named pipe nobody writes; for a reader that takes it a chunk at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotAFile(kind(mode))
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bounded(path: Path, limit: int, pipes: bool = False) -> bytes:
    """The bytes of regular file `path` (with `pipes`: of a pipe too, read to its end), at most
    `limit` of them. NotAFile for anything else (a device, a socket, a directory), TooLarge past
    `limit`, OSError when it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO without a writer
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISFIFO(mode) and pipes:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # wait for its writer
        elif not stat.S_ISREG(mode):
            raise NotAFile(kind(mode))
        return _read(fd, limit)
    finally:
        os.close(fd)


def _read(fd: int, limit: int) -> bytes:
    parts, size = [], 0
    while size <= limit:
        part = os.read(fd, min(CHUNK, limit + 1 - size))
        if not part:
            return b"".join(parts)
        parts.append(part)
        size += len(part)
    raise TooLarge(f"more than {limit:,} bytes")


def kind(mode: int) -> str:
    return next((words for test, words in KINDS if test(mode)), "not a regular file")
