"""What a save really costs the loop, measured on the loop's own clock: not only the time it
was blocked (capture, copy, waits) but also how much slower its steps ran while the write
was in flight (the writer's share of the cores, the page faults, a peer waiting for this
rank at the next all-reduce). The blocked time alone undercounts an asynchronous save by
whatever the background write takes from the steps around it.

The clock's marks are step ends (the moment a step is done and its `step` record made), so
the trainer's windows and typical step are the ones its step records show; not the next
step's start, as between the two lie the SDC check and the stop vote, which wait for the
peers, and a write that ends there would close a window the records see closing a step
later. A save's window
opens when the loop enters the save (after its step, and after any evaluation due at that
step) and closes at the first step end after its write ended (an async save), when the save
returns (a save written while the loop waited: blocking, or the final one), or when the next
save begins with its write still in flight (the wait for it is the next save's). Its cost is
the window's length minus the steps completed in it at the typical step time, the median of
the recent step intervals (step end to step end) that no save or write touched:

    cost = (closed - opened) - steps_in_window x typical_step

An interval is touched when a window was open during any of it: from the one the save falls
in (after the end of the step it saves, before the end of the next) to the one whose end
closes the window; the step after that is quiet again. The first WARMUP_STEPS
intervals (allocation, first collectives, lazy imports) are nobody's typical step. A window
with no typical step yet (a save before any quiet step) counts its steps as free: its cost
is then its length, an upper bound.

Each mark is one clock reading that the record of that moment carries too (the `step`
record, the save's `phase checkpoint` record: worker/reporting.py, worker/train.py), so
bench/save_loss.py reads these same windows and typical step off the records. The two can
differ only where a step ends in the microseconds between a write's `checkpoint` record and
the moment the loop can see that write ended.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

QUIET_STEPS = 32  # the recent quiet intervals whose median is the typical step
WARMUP_STEPS = 2  # the first intervals (allocation, first collectives, lazy imports) are no typical step


@dataclass
class Window:
    step: int
    opened: float
    steps: int = 0  # steps completed since it opened


@dataclass(frozen=True)
class Closed:
    step: int  # the save's step
    cost: float  # seconds the save cost the loop
    steps: int  # steps completed in its window


class LoopCost:
    def __init__(self) -> None:
        self._quiet: deque[float] = deque(maxlen=QUIET_STEPS)
        self._last_end: float | None = None
        self._touched = False  # a window was open during the interval since the last step end
        self._intervals = 0
        self.window: Window | None = None

    @property
    def typical_step(self) -> float | None:
        return statistics.median(self._quiet) if self._quiet else None

    def step_ended(self, now: float, write_ended: bool) -> Closed | None:
        """A step ended at `now`. `write_ended`: the open save's write is known to have ended
        (or it had none here): its window closes at this step end."""
        if self._last_end is not None:
            self._intervals += 1
            if not self._touched and self._intervals > WARMUP_STEPS:
                self._quiet.append(now - self._last_end)
        self._last_end = now
        closed = None
        if self.window is not None:
            self.window.steps += 1
            if write_ended:
                closed = self.close(now)
        self._touched = self.window is not None  # the next step runs while the write is in flight
        return closed

    def open(self, step: int, now: float) -> None:
        self.window, self._touched = Window(step, now), True

    def close(self, now: float) -> Closed | None:
        """Closes the open window at `now` (a step end, the save's return, the next save's start,
        the loop leaving)."""
        window, self.window = self.window, None
        if window is None:
            return None
        typical = self.typical_step or 0.0
        return Closed(window.step, (now - window.opened) - window.steps * typical, window.steps)
