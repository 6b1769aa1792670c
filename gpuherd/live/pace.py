"""A script rank's pace: its compute per step, the straggler check's measure (the built-in trainer's
comes from gpuherd/liveness.py and worker/collectives.py).

In synchronous training every rank's step takes the same wall time: the fast ranks wait for the
slow one in the gradient all-reduce. What tells them apart is the step's time minus that wait.
DDP all-reduces a bucket as soon as its gradients are ready, inside backward, through the
session's communication hook (gpuherd/live/ddp.py's `SafeReduce`): when the step's last bucket is
handed over, this rank's own backward is done (`ready`); from then until the last all-reduce of
the step completes (`reduced`, from the backend's thread), it waits for the others. A step whose
group broke (a lost peer) is not counted, nor one that all-reduced nothing (the wait is unknown).

All of it is the host's clock: checked with gloo on CPU ranks; on GPUs, whose kernels run apart
from the host, it has not been tried. The sums since the last `take` go on the session's `step`
records (`steps`, `compute_s`, `wait_s`), which the supervisor's straggler check reads as it
reads the trainer's `alive` records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StepPace:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None  # the step in flight began
        self._ready: float | None = None  # its last bucket was handed to the all-reduce
        self._reduced: float | None = None  # its latest all-reduce completed
        self._steps, self._compute, self._wait = 0, 0.0, 0.0  # since the last `take`

    def begin(self) -> None:
        """A step begins (the loop's body runs from here)."""
        with self._lock:
            self._started, self._ready, self._reduced = self._clock(), None, None

    def ready(self) -> None:
        """A gradient bucket was handed to the all-reduce (the hook; the last one ends local backward)."""
        now = self._clock()
        with self._lock:
            self._ready = now

    def reduced(self) -> None:
        """A bucket's all-reduce completed (any thread)."""
        now = self._clock()
        with self._lock:
            self._reduced = now if self._reduced is None else max(self._reduced, now)

    def end(self, counted: bool = True) -> None:
        """The step ended; `counted` False: its group broke, it says nothing of this rank's pace."""
        now = self._clock()
        with self._lock:
            started, ready, reduced, self._started = self._started, self._ready, self._reduced, None
            if started is None or not counted or ready is None:  # no all-reduce: nothing to tell the wait by
                return
            duration = now - started
            wait = 0.0 if reduced is None else min(max(0.0, min(reduced, now) - ready), duration)
            self._steps += 1
            self._compute += duration - wait
            self._wait += wait

    def take(self) -> dict[str, float | int]:
        """The step record's fields since the last call (none when no step was counted)."""
        with self._lock:
            steps, compute, wait = self._steps, self._compute, self._wait
            self._steps, self._compute, self._wait = 0, 0.0, 0.0
        if not steps:
            return {}
        return {"steps": steps, "compute_s": round(compute, 4), "wait_s": round(wait, 4)}
