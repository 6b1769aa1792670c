"""Node 0's own stalls: a node agent that did not run (SIGSTOP, a frozen VM, swapping, a
starved core) must not read what its stall caused as another node's death.

While node 0's agent stands still, the job store it hosts answers nobody: every other node's
store watchdog ends that node after SILENT_S without an answer, and its beats stop. When node 0
runs again it finds their connections closed and their beats still, and would name the first
of them dead: a healthy node blamed for node 0's stall. So a ticker thread notes each gap in
its own ticks; the time node 0 stood still is nobody's silence, and a node whose connection closed during
such a stall or just after it (one long enough for the other nodes to give node 0 up) was lost
to node 0's stall, and is said so: node 0 is named, never the healthy node.

A ticker thread rather than the loop's own clock: the loop may block in a store call for a
while for reasons of the network, which is not node 0 standing still.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

TICK_S = 0.25  # how often the ticker notes that it ran
STALL_S = 2.0  # a gap in the ticks this long is a stall of this process (a busy host delays a tick by ms, not s)


class OwnLag:
    """The stalls of this process, from the gaps in a ticker thread's ticks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, start: bool = True) -> None:
        self._clock = clock
        self._last = clock()
        self._lock = threading.Lock()
        self.stalls: list[tuple[float, float]] = []  # (when it ended, how long it lasted)
        self._untaken = 0.0  # stalled seconds not yet handed to take_new()
        if start:
            threading.Thread(target=self._tick_forever, name="own-lag", daemon=True).start()

    def _tick_forever(self) -> None:
        while True:
            time.sleep(TICK_S)
            self.tick()

    def tick(self) -> None:
        now = self._clock()
        with self._lock:
            gap = now - self._last
            self._last = now
            if gap >= STALL_S:
                self.stalls.append((now, gap))
                del self.stalls[:-8]
                self._untaken += gap

    def take_new(self) -> float:
        """The seconds this process stood still since the last call (0.0: none), each stall once."""
        self.tick()
        with self._lock:
            taken, self._untaken = self._untaken, 0.0
        return taken

    def thawed_at(self) -> float:
        """When this process last ran again after a stall (its clock); -inf: it never stood still.
        Ticks first: a stall the ticker has not seen yet (this thread ran first) counts too."""
        self.tick()
        with self._lock:
            return self.stalls[-1][0] if self.stalls else float("-inf")

    def stalled_within(self, window_s: float) -> float | None:
        """The longest stall that ended in the last `window_s` seconds, or is still going on (this
        thread ran before the ticker did); None: none."""
        now = self._clock()
        with self._lock:
            ongoing = now - self._last
            longest = max((gap for ended, gap in self.stalls if now - ended <= window_s), default=0.0)
        longest = max(longest, ongoing if ongoing >= STALL_S else 0.0)
        return longest or None
