"""Liveness from a thread of its own: where the training loop is, even while it is stuck.

A rank whose loop waits in a collective for a stopped peer sends nothing, exactly
like the stopped peer; judged by silence alone, the wrong one gets blamed. Here a
daemon thread, independent of the loop, sends an `alive` record every `interval`
seconds carrying the loop's whereabouts:

    phase     step | eval | checkpoint | init | rendezvous | compile | ... (what is timed)
    step      the step the loop is in (or just finished, outside a step)
    for_s     seconds in this phase instance (this step, this eval)
    where     what the loop does inside it: data loading, forward/backward, a collective's name
    where_s   seconds at `where`
    collective  true while the loop waits for the other ranks

and, since the previous record, what the supervisor learns timeouts and spots
stragglers from: `took` ({phase: [count, longest seconds]}) and, over the steps that
ended, `steps`, `compute_s` (step time minus time waiting in collectives) and `wait_s`.

The loop only assigns a tuple (`_where`) on each change: no lock, no system call;
step and collective bookkeeping takes a lock the thread holds for microseconds.

On a hang verdict the supervisor asks every rank for its collective trace by creating
`<trace_dir>/request`; this thread (the main one may be stuck inside the collective)
notices it within one interval and calls the `dump` callback the worker registered
with the trace directory (gpuherd's worker dumps PyTorch's flight recorder there).

torch-free, so the built-in worker and a script's bootstrap share it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from loguru import logger

from gpuherd.status_channel import StatusWriter

INTERVAL_S = 1.0
STEP = "step"
BETWEEN = "between steps"  # after a step or a timed phase ended, before the next one starts


class Where(NamedTuple):
    """One immutable snapshot of the loop's whereabouts (replaced whole, never mutated)."""

    phase: str
    step: int | None
    phase_since: float
    activity: str
    activity_since: float
    collective: bool


class Liveness:
    def __init__(self, status: StatusWriter, interval: float = INTERVAL_S, trace_dir: Path | None = None,
                 dump: Callable[[Path], None] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._status, self.interval, self._clock = status, interval, clock
        self._trace_dir, self._dump = trace_dir, dump
        now = clock()
        self._where = Where("init", None, now, "starting", now, False)
        self._before_collective: Where | None = None
        self._lock = threading.Lock()
        self._took: dict[str, list[float]] = {}  # phase -> [count, longest], since the last record
        self._steps, self._compute, self._wait = 0, 0.0, 0.0  # since the last record
        self._step_wait = 0.0  # time waited in collectives during the open step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._request_seen: tuple[int, int] | None = None

    # ------------------------------------------------------------------ the loop's side

    @property
    def where(self) -> Where:
        return self._where

    def at(self, phase: str, activity: str | None = None) -> None:
        """An untimed phase (init, rendezvous, compile): whereabouts only."""
        now = self._clock()
        self._close_step(now)
        self._where = Where(phase, self._where.step, now, activity or phase, now, False)

    def step(self, n: int) -> None:
        """The loop starts step `n`; the previous step (if one is open) ends here."""
        now = self._clock()
        self._close_step(now)
        self._where = Where(STEP, n, now, STEP, now, False)

    def doing(self, activity: str) -> None:
        """What the loop does now inside its phase (data loading, forward/backward, ...)."""
        w = self._where
        if w.activity != activity or w.collective:
            self._where = w._replace(activity=activity, activity_since=self._clock(), collective=False)

    def collective_begin(self, name: str) -> None:
        """The loop now waits for the other ranks in collective `name` (a hook may call this)."""
        w = self._where
        if w.collective:
            return
        self._before_collective = w
        self._where = w._replace(activity=name, activity_since=self._clock(), collective=True)

    def collective_end(self) -> None:
        w = self._where
        if not w.collective:
            return
        now = self._clock()
        with self._lock:
            self._step_wait += now - w.activity_since
        back = self._before_collective
        self._where = w._replace(activity=back.activity if back else STEP, activity_since=now, collective=False)

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        self.collective_begin(name)
        try:
            yield
        finally:
            self.collective_end()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A timed phase outside the steps (eval, checkpoint): its duration is reported under `name`."""
        start = self._clock()
        self._close_step(start)
        before = self._where
        self._where = Where(name, before.step, start, name, start, False)
        try:
            yield
        finally:
            end = self._clock()
            self._took_add(name, end - start)
            self._where = Where(BETWEEN, before.step, end, BETWEEN, end, False)

    def _close_step(self, now: float) -> None:
        w = self._where
        if w.phase != STEP:
            return
        if w.collective:
            self.collective_end()
        duration = now - w.phase_since
        with self._lock:
            wait, self._step_wait = min(self._step_wait, duration), 0.0
            self._steps += 1
            self._compute += duration - wait
            self._wait += wait
            self._took_add_locked(STEP, duration)
        self._where = w._replace(phase=BETWEEN, phase_since=now, activity=BETWEEN, activity_since=now)

    def _took_add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._took_add_locked(phase, seconds)

    def _took_add_locked(self, phase: str, seconds: float) -> None:
        entry = self._took.setdefault(phase, [0, 0.0])
        entry[0] += 1
        entry[1] = max(entry[1], seconds)

    # ------------------------------------------------------------------ the thread's side

    def record(self) -> dict:
        """The `alive` record's fields now; resets the since-last-record counters."""
        now, w = self._clock(), self._where
        fields: dict = {"phase": w.phase, "step": w.step, "for_s": round(now - w.phase_since, 3),
                        "where": w.activity, "where_s": round(now - w.activity_since, 3),
                        "collective": w.collective}
        with self._lock:
            took, self._took = self._took, {}
            steps, compute, wait = self._steps, self._compute, self._wait
            self._steps, self._compute, self._wait = 0, 0.0, 0.0
        if took:
            fields["took"] = {k: [int(n), round(longest, 4)] for k, (n, longest) in took.items()}
        if steps:
            fields.update(steps=steps, compute_s=round(compute, 4), wait_s=round(wait, 4))
        return fields

    def start(self) -> Liveness:
        if self._status.connected and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpuherd-liveness", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
            self._thread = None

    def _run(self) -> None:
        while True:
            self._status.send("alive", **self.record())
            self._answer_trace_request()
            if self._stop.wait(self.interval):
                return

    def _answer_trace_request(self) -> None:
        if self._trace_dir is None or self._dump is None:
            return
        try:
            st = os.stat(self._trace_dir / "request")
        except OSError:
            return
        seen = (st.st_ino, st.st_mtime_ns)
        if seen == self._request_seen:
            return
        self._request_seen = seen
        # In a thread of its own: a dump that blocks must not silence the liveness records.
        threading.Thread(target=self._dump_trace, name="gpuherd-trace-dump", daemon=True).start()

    def _dump_trace(self) -> None:
        try:
            self._dump(self._trace_dir)
        except Exception as exc:  # a failed dump is a missing trace, never a dead worker
            logger.warning(f"collective trace dump to {self._trace_dir} failed: {exc}")
