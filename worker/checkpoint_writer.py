"""One checkpoint being written in the background while the loop trains on
(worker/saver.py starts at most one at a time).

A thread of its own waits for the write; the write itself runs in the rank's writer process
(worker/save_writer.py: one-file checkpoints, rank 0 alone) or, where every rank must take
part in the write's collectives (FSDP's sharded checkpoints through DCP), in the thread,
which then runs at a lower CPU priority (nice +WRITER_NICE for this thread only): where the
cores are busy with training, the loop keeps them and the write takes the rest; on an idle
CPU (a GPU run) it changes nothing. Its outcome, the published path or the exception, is
kept for the loop to collect at its next step.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WRITER_NICE = 5


@dataclass(frozen=True)
class Written:
    """A published write: where, and the CPU seconds it took where it ran (user + system: the
    writer process's, or the thread's that wrote it). CPU time, unlike wall time, does not
    grow with the load of a shared machine; on a CPU run it is what the write took from the ranks."""

    path: Path
    cpu_s: float


def written_here(write: Callable[[], Path]) -> Written:
    """`write` run in this thread, its CPU time counted."""
    started = time.thread_time()
    path = write()
    return Written(path, time.thread_time() - started)


class BackgroundWrite:
    def __init__(self, step: int, path: Path, write: Callable[[], Written],
                 on_done: Callable[[BackgroundWrite], None], writer_pid: int | None = None) -> None:
        """`writer_pid`: `write` hands the save to that writer process (worker/save_writer.py) and
        this thread only waits for its answer; None: the thread writes, at a lower priority."""
        self.step, self.path = step, path
        self.published: Path | None = None
        self.cpu_s: float | None = None  # the write's CPU seconds, once published
        self.error: BaseException | None = None
        self.write_s: float | None = None  # set once it ended, either way
        self.writer_pid = writer_pid
        self._write, self._on_done = write, on_done
        self._done = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=f"gpuherd-checkpoint-writer-{step}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def describe(self) -> str:
        """Who writes what, for the loop's liveness while it waits (a stuck writer is named)."""
        who = f"the checkpoint writer (pid {self.writer_pid})" if self.writer_pid else "the checkpoint writer"
        return f"the wait for {who} writing {self.path.name} (step {self.step})"

    def wait(self, timeout: float | None = None) -> bool:
        """True once the write ended (published or failed); False if `timeout` ran out first."""
        return self._done.wait(timeout)

    def _run(self) -> None:
        try:
            if self.writer_pid is None:
                _lower_priority()
            written = self._write()
            self.published, self.cpu_s = written.path, written.cpu_s
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it there
            self.error = exc
        finally:
            self.write_s = time.perf_counter() - self._started
            try:
                self._on_done(self)
            finally:
                self._done.set()


def _lower_priority() -> None:
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICE))
    except (OSError, AttributeError):  # not Linux, or not allowed: write at the loop's priority
        pass
