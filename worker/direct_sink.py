"""Where a one-file checkpoint's bytes go on their way to disk when they lie page-aligned in
memory (the async saver's shared buffer, worker/save_snapshot.py): each byte hashed once (the
manifest's digest) and the large records written straight from that memory to the disk
(O_DIRECT), without passing through the page cache.

Why: through the page cache, the writer's CPU per save is not only the digest but a copy of
every byte into freshly allocated page-cache pages and, at the fsync, their writeback (as
much system time again as the copy). On a CPU run every CPU second of the writer is taken
from a rank, which the other rank then waits for at the next all-reduce. Written directly,
the bytes go from the buffer to the disk by DMA: what is left of the writer's CPU is the
digest. The file stays the same torch.save zip (records aligned to ALIGN bytes through torch's
own `storage_alignment`, recorded in the file, which torch.load honours); only how its bytes
travel changes.

A byte goes directly when its record's data starts ALIGN-aligned both in memory and in the
file; everything else (zip headers, the pickle, small tensors, the tail of each large one, a
tensor not aligned in memory) is gathered in an aligned bounce buffer and written in whole
blocks. The file's last partial block is written padded to a whole one and the file then cut
to its true size. Where the filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE
ones: EINVAL at the fcntl or at a write), the same bytes are written the ordinary way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from gpuherd.checkpoint_manifest import FileDigest, new_hash

ALIGN = 4096  # O_DIRECT's alignment (the device's logical block, 512 or 4096) in memory, offset and length
BOUNCE = 8 << 20  # whole blocks gathered before a write: large enough that headers cost no extra writes
CHUNK = 256 << 20  # at most this much per direct write: a write is never longer than Linux allows


class DirectSink:
    """A write-only stream for torch.save over an open file descriptor positioned at 0."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.direct = _set_direct(fd, True)
        self._hash, self._size = new_hash(), 0
        self._bounce = mmap.mmap(-1, BOUNCE)  # page-aligned, as O_DIRECT wants
        self._fill = 0  # bytes gathered in the bounce buffer, at file offset _size - _fill
        self.direct_bytes = 0  # written straight from the caller's memory

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if not n:
            return 0
        self._hash.update(view)
        done = 0
        if self.direct and n >= ALIGN and self._fill % ALIGN == 0 and _address(view) % ALIGN == 0:
            self._drain()  # whole blocks: the file is now aligned where `view` goes
            done = n - n % ALIGN
            self._write_direct(view[:done])
        while done < n:
            took = min(n - done, BOUNCE - self._fill)
            self._bounce[self._fill:self._fill + took] = view[done:done + took]
            self._fill, done = self._fill + took, done + took
            if self._fill == BOUNCE:
                self._drain()
        self._size += n
        return n

    def flush(self) -> None:
        """Everything written so far reaches the file (torch.save calls it once, at its end). In
        direct mode a partial last block goes out padded, the file is cut back to its true size,
        and the sink goes on with ordinary writes should more come."""
        if self._fill:
            if self.direct:
                whole = -(-self._fill // ALIGN) * ALIGN
                self._bounce[self._fill:whole] = bytes(whole - self._fill)
                self._write_all(memoryview(self._bounce)[:whole])
                os.ftruncate(self.fd, self._size)
                os.lseek(self.fd, self._size, os.SEEK_SET)
                self.direct = _set_direct(self.fd, False)
            else:
                self._write_all(memoryview(self._bounce)[:self._fill])
            self._fill = 0

    def close(self) -> None:
        """Back to an ordinary descriptor (the caller fsyncs and closes it); what was not flushed
        is dropped (a save that failed midway: its temp file is removed anyway)."""
        if self.direct:
            self.direct = _set_direct(self.fd, False)
        self._bounce.close()

    def digest(self) -> FileDigest:
        return FileDigest(self._size, self._hash.hexdigest())

    def _drain(self) -> None:
        """The bounce buffer's whole blocks out (all of it outside direct mode)."""
        whole = self._fill - self._fill % ALIGN if self.direct else self._fill
        if not whole:
            return
        self._write_all(memoryview(self._bounce)[:whole])
        rest = self._fill - whole
        if rest:
            self._bounce[:rest] = self._bounce[whole:self._fill]
        self._fill = rest

    def _write_direct(self, view: memoryview) -> None:
        self._write_all(view)
        self.direct_bytes += len(view)

    def _write_all(self, view: memoryview) -> None:
        written = 0
        while written < len(view):
            try:
                written += os.write(self.fd, view[written:written + CHUNK])
            except OSError as exc:
                if exc.errno != errno.EINVAL or not self.direct:
                    raise
                # refused (an alignment this device does not take, or a short write that left
                # the offset unaligned): the rest goes the ordinary way, from where it stands
                self.direct = _set_direct(self.fd, False)


@contextlib.contextmanager
def page_aligned_records() -> Iterator[None]:
    """torch.save places each record's data at an ALIGN-aligned file offset (torch's own switch,
    written into the file as `.storage_alignment`; global: restored after). A torch without it
    keeps 64: the sink then gathers everything through its bounce buffer."""
    config = getattr(getattr(getattr(torch.utils, "serialization", None), "config", None), "save", None)
    if config is None or not hasattr(config, "storage_alignment"):
        yield
        return
    before = config.storage_alignment
    config.storage_alignment = ALIGN
    try:
        yield
    finally:
        config.storage_alignment = before


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def _set_direct(fd: int, on: bool) -> bool:
    """Whether `fd` now writes directly (False where the filesystem refuses it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    want = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, want)
    except OSError:
        return False
    return on
