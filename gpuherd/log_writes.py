"""Log writes that a full or failing disk cannot turn into a crash.

The run's logs (worker logs, `supervisor.log`, `metrics.jsonl`) are a record of the
training, not the training itself: when their disk fills up (or its quota, a file-size
limit, a read-only remount, an I/O error) the workers keep training. Each write that
fails is dropped and counted, one WARNING names the disk and why (to the console: the
log file is what failed), and the run's summary says how many lines were lost.

    LOG_WRITES.write(fd, data, path)     # every log file of the supervisor process
    LOG_WRITES.note()                    # None, or the summary's line about what was lost
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

from gpuherd.files import open_log
from gpuherd.storage import STORAGE_ERRNOS, format_bytes, free_bytes

# what a log write may meet that is the disk's fault, not the run's
DISK_ERRNOS = {**STORAGE_ERRNOS, errno.EIO: "input/output error (a failing disk or a lost network mount)"}


class LogWrites:
    def __init__(self) -> None:
        self.dropped = 0  # writes (lines, or a line's worth of a batch) that never reached their file
        self.first: str | None = None  # "DIR: reason", the first failure
        self._warn: Callable[[str], None] | None = None
        self._lock = threading.Lock()

    def on_first_failure(self, warn: Callable[[str], None]) -> None:
        """Who tells the user (once): the supervisor's console WARNING."""
        self._warn = warn

    def open(self, path: Path) -> int | None:
        """`open_log(path)`, or None when the disk refuses even that (every write then counts as dropped)."""
        try:
            return open_log(path)
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self._dropped(path, exc.errno, 0)
            return None

    def write(self, fd: int | None, data: bytes, path: Path) -> bool:
        """All of `data` at `fd`, or nothing more once the disk fails: False, counted, warned once."""
        if fd is None:
            self._dropped(path, None, max(1, data.count(b"\n")))
            return False
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
            return True
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self._dropped(path, exc.errno, max(1, bytes(view).count(b"\n")))
            return False

    def _dropped(self, path: Path, code: int | None, lines: int) -> None:
        with self._lock:
            self.dropped += lines
            if self.first is not None or code is None:
                return
            free = free_bytes(path.parent)
            self.first = (f"{path.parent}: {DISK_ERRNOS[code]}"
                          + (f" ({format_bytes(free)} free)" if free is not None else ""))
        if self._warn is not None:
            self._warn(f"cannot write logs to {self.first}: log lines are dropped (counted) from now on; "
                       "the workers keep training")

    def note(self) -> str | None:
        if not self.dropped:
            return None
        return (f"{self.dropped:,} log line(s) could not be written ({self.first}); the console showed what "
                "it could")


LOG_WRITES = LogWrites()  # one per process: the supervisor's log files all count here


def quiet_writer_thread_disk_errors() -> None:
    """A disk error that ends a log writer's own thread (TensorBoard's event thread) is not
    printed as a traceback: the sink raises it again in the training thread, where it is
    dropped and said once."""
    if getattr(threading.excepthook, "gpuherd_quiet", False):
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in DISK_ERRNOS:
            return
        previous(args)

    hook.gpuherd_quiet = True  # type: ignore[attr-defined]
    threading.excepthook = hook
