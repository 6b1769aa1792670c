"""Publishing the root cause off the supervision loop (supervision.py).

`on_cause` may be slow: under SLURM, attempt_run.py asks `scontrol` why the job was stopped (up
to its timeout); multi-node, the cause goes to the store. So it runs on a worker thread, its
answer is queued and the loop is woken to read it (`answers`); at the end the loop waits for the
answers still out at most ANNOUNCE_WAIT (`wait`), and one that comes later is dropped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

from loguru import logger

from supervisor.summary import RootCause

ANNOUNCE_WAIT = 8.0  # at the end: the longest wait for a root cause still being published (scontrol's 5 s)


class Announcer:
    def __init__(self, on_cause: Callable[[RootCause], RootCause | None] | None, wake: Callable[[], None]) -> None:
        """`on_cause`: what publishes a cause (its answer: the cause as published, or None);
        None: nothing is published.
        `wake`: wakes the loop (thread-safe) once an answer is queued."""
        self._on_cause = on_cause
        self._wake = wake
        self.published: queue.SimpleQueue[tuple[RootCause, RootCause | None]] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # an answer after the wait is over is dropped, never woken for
        self._open = True

    def announce(self, cause: RootCause) -> None:
        """`on_cause` on a worker thread: it may ask SLURM (a subprocess, seconds) or the store."""
        if self._on_cause is None:
            return

        def publish() -> None:
            try:
                published = self._on_cause(cause)
            except Exception as exc:  # noqa: BLE001 - the cause stands as it is; the run goes on
                logger.warning(f"the root cause could not be published: {type(exc).__name__}: {exc}")
                published = None
            with self._lock:
                if self._open:  # else the loop is over and its wake-up pipe may be closed
                    self.published.put((cause, published))
                    self._wake()

        thread = threading.Thread(target=publish, name="gpuherd-publish", daemon=True)
        self.threads.append(thread)
        thread.start()

    def answers(self) -> Iterator[tuple[RootCause, RootCause | None]]:
        """Each (cause, as published) queued so far, oldest first, until none is left."""
        while not self.published.empty():
            yield self.published.get()

    def wait(self) -> None:
        """The root cause as published becomes the attempt's, so its answer is waited for
        (bounded); after this, no answer is queued any more."""
        deadline = time.monotonic() + ANNOUNCE_WAIT  # a real wait, whatever clock the policy is given
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._open = False
        if any(thread.is_alive() for thread in self.threads):
            logger.warning(f"publishing the root cause took over {ANNOUNCE_WAIT:g} s: it stands as this node saw it")
