"""Storage failures named in plain words: a full disk, a quota, a file-size limit, a
read-only filesystem. Restarting into any of them fails the same way, so they get
their own exit code (`ExitCode.STORAGE`) instead of a traceback and "failure".

Writers rarely raise the OSError itself: torch's zip writer turns a failed write into
"unexpected pos ..." and torch.distributed.checkpoint wraps every rank's exception, so
`storage_errno` looks through the whole cause chain, and `probe_errno` asks the
filesystem directly when nothing in the chain says why.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

STORAGE_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for this process's file-size limit (ulimit -f) or the filesystem",
    errno.EROFS: "read-only file system",
}


def storage_errno(exc: BaseException) -> int | None:
    """The storage errno behind `exc`, looking through causes, contexts and
    torch.distributed.checkpoint's per-rank failures; None when it is something else."""
    for item in _chain(exc, depth=0):
        if isinstance(item, OSError) and item.errno in STORAGE_ERRNOS:
            return item.errno
        text = str(item)
        for code in STORAGE_ERRNOS:
            if os.strerror(code) in text:
                return code
    return None


def _chain(exc: BaseException, depth: int) -> Iterator[BaseException]:
    if depth > 20:  # cycles and pathological chains end here
        return
    yield exc
    for nested in (exc.__cause__, exc.__context__):
        if nested is not None:
            yield from _chain(nested, depth + 1)
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict):
        for value in failures.values():
            inner = value[0] if isinstance(value, tuple) and value else value
            if isinstance(inner, BaseException):
                yield from _chain(inner, depth + 1)


def probe_errno(directory: Path, size: int = 1 << 20) -> int | None:
    """Write and remove `size` bytes in `directory`: the storage errno that fails, or None."""
    probe = directory / f".gpuherd-write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as handle:
            handle.write(b"\0" * size)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        return exc.errno if exc.errno in STORAGE_ERRNOS else None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return None


def free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def format_bytes(n: float) -> str:
    """`1.5 GB`, `512.0 MB`, `12.0 KB`: decimal units, as `df -H` and disk vendors count."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def storage_message(what: str, directory: Path, code: int, needed: int | None) -> str:
    """"cannot save checkpoint to DIR: no space left on device (needs ~X GB, Y GB free)"."""
    free = free_bytes(directory)
    numbers = []
    if needed:
        numbers.append(f"needs ~{format_bytes(needed)}")
    if free is not None:
        numbers.append(f"{format_bytes(free)} free")
    detail = f" ({', '.join(numbers)})" if numbers else ""
    return f"cannot save {what} to {directory}: {STORAGE_ERRNOS[code]}{detail}"
