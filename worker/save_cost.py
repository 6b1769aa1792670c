"""What a save really costs the loop, measured on the loop's own clock: not only the time it
was blocked (capture, copy, waits) but also how much slower its steps ran while the write
was in flight (the writer's share of the cores, the page faults, a peer waiting for this
rank at the next all-reduce). The blocked time alone undercounts an asynchronous save by
whatever the background write takes from the steps around it.

A save's window opens when the loop enters the save (after its step, and after any
evaluation due at that step) and closes at the first step boundary where its write is known
to have ended (a blocking save: the next boundary; the final save: when it returns). Its
cost is the window's length minus the training steps completed in it at the typical step
time, the median of the recent step intervals that no save or write touched:

    cost = (closed - opened) - steps_in_window x typical_step

This is what the step records show (the intervals around a save, less the usual step), so
the trainer's account and a measure from its records agree. A window with no typical step
yet (a save before any quiet step) counts its steps as free: its cost is then its length,
an upper bound.
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
    ticks: int = 0  # step boundaries passed since it opened


class LoopCost:
    def __init__(self) -> None:
        self._quiet: deque[float] = deque(maxlen=QUIET_STEPS)
        self._last_tick: float | None = None
        self._touched = False  # a save or a write touched the interval since the last tick
        self._intervals = 0
        self.window: Window | None = None

    @property
    def typical_step(self) -> float | None:
        return statistics.median(self._quiet) if self._quiet else None

    def tick(self, now: float) -> None:
        """A step boundary (the loop is about to train its next step)."""
        if self._last_tick is not None:
            self._intervals += 1
            if not self._touched and self.window is None and self._intervals > WARMUP_STEPS:
                self._quiet.append(now - self._last_tick)
        self._last_tick, self._touched = now, self.window is not None
        if self.window is not None:
            self.window.ticks += 1

    def open(self, step: int, now: float) -> None:
        self.window, self._touched = Window(step, now), True

    def close(self, now: float, at_tick: bool) -> tuple[int, float, int] | None:
        """Closes the open window at `now`: a step boundary just ticked (`at_tick`), or a point
        right after a step (a save, the loop leaving). Returns (step, cost, steps in it)."""
        window, self.window = self.window, None
        if window is None:
            return None
        # the first boundary after the save comes before any step; a close after a step
        # (not at a boundary) counts the step since the last boundary
        steps = max(0, window.ticks - 1) if at_tick else window.ticks
        typical = self.typical_step or 0.0
        return window.step, (now - window.opened) - steps * typical, steps
