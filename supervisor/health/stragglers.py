"""Stragglers: the rank the others wait for, named while the run goes on.

In synchronous training every rank's step takes the same wall-clock time: the fast
ranks wait for the slow one in the collectives. What tells them apart is *compute*
time per step, step time minus time waiting in collectives, which gpuherd/liveness.py
measures in each worker (the `alive` records carry the sums), and gpuherd/live/pace.py in each
rank of a script recovered live through gpuherd.live (its `step` records carry them). Every `WINDOW_S` (longer
when steps are slow: a window holds at least `MIN_STEPS` steps of every rank) each
rank's mean compute per step is divided by the median of the other ranks'; a rank
above `factor` for `windows` windows in a row gets one WARNING naming it, its slowdown
and the likely reason from its latest GPU sample (thermal or power slowdown, clocks
held back, another process on its GPU) or host sample (less CPU than the others); a
`{"type": "straggler"}` record goes to metrics.jsonl and the summary lists it. A rank
that recovers and slows down again is reported again.

Every window closed also goes to the move-out decision (straggler_moves.py: a rank slower than
2x for 30 s is moved out live where a warm spare can take it), and a named rank's stretch is
costed: in each of its windows every step waited for its compute beyond the others' median
(`steps x (its compute - the others')`, at most the window); when the stretch ends (the rank is
back under the factor, it is moved out, or the attempt ends) a `timeline`/`straggler` record
carries the sum (`lost_s`: the goodput account's `straggler` badput).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from loguru import logger

from gpuherd.status_records import Alive, Step
from supervisor.goodput import marks
from supervisor.health.straggler_moves import Due, MoveOut, Window, after_line


class NodeJudge(Protocol):
    """Node 0's judge of every node's pace (node_stragglers.py), ticked with a node's own ranks."""

    found: list[dict[str, Any]]

    def tick(self, now: float) -> None: ...

    def close(self, now: float) -> None: ...

WINDOW_S = 5.0
MIN_STEPS = 2  # a window closes only once every rank finished this many steps in it
LESS_CPU = 0.7  # a rank's CPU share below this fraction of the others' is a likely reason
THERMAL = {"sw_thermal", "hw_thermal"}
POWER = {"sw_power_cap", "hw_power_brake"}


def likely_reason(gpu: dict[str, Any] | None, host: dict[str, Any] | None, others_cpu: list[float]) -> str | None:
    """What the monitor's latest samples say about a slow rank, or None."""
    if gpu:
        events = set(gpu.get("clock_events") or []) if isinstance(gpu.get("clock_events"), list) else set()
        if events & THERMAL:
            return f"thermal slowdown ({gpu.get('temp')} C, slowdown at {gpu.get('temp_slowdown')} C)"
        if events & POWER:
            return f"power capping ({gpu.get('power_w')} of {gpu.get('power_limit_w')} W)"
        if "hw_slowdown" in events:
            return "hardware slowdown: clocks held back"
        if isinstance(gpu.get("foreign"), list) and gpu["foreign"]:
            pids = ", ".join(str(p.get("pid")) for p in gpu["foreign"][:3])
            return f"another process on its GPU (pid {pids})"
    if host and others_cpu and isinstance(host.get("cpu_percent"), (int, float)):
        median = statistics.median(others_cpu)
        if median > 0 and host["cpu_percent"] < LESS_CPU * median:
            return (f"its process got less CPU ({host['cpu_percent']:.0f}% vs {median:.0f}% for the others): "
                    "CPU contention, or it keeps being stopped")
    return None


class SlowStreaks:
    """Windows in a row each rank (or node) was slow in, and which are named: one is named once
    per slow stretch, when its streak reaches `windows`; back to pace, it may be named again."""

    def __init__(self, windows: int) -> None:
        self.windows = windows
        self._streak: dict[int, int] = {}
        self.named: set[int] = set()

    def slow(self, key: int) -> bool:
        """One more window slow; True the moment it is due to be named."""
        self._streak[key] = self._streak.get(key, 0) + 1
        if self._streak[key] >= self.windows and key not in self.named:
            self.named.add(key)
            return True
        return False

    def clear(self, key: int) -> None:
        """Back to pace (or moved out): its count starts again."""
        self._streak[key] = 0
        self.named.discard(key)


class Stragglers:
    def __init__(self, factor: float, windows: int, write: Callable[[dict[str, Any]], None],
                 window_s: float = WINDOW_S, warn: Callable[[str], None] = logger.warning,
                 moves: MoveOut | None = None, pace: Callable[[float, int], None] | None = None,
                 nodes: NodeJudge | None = None, solo: bool = False) -> None:
        """`moves`: the move-out decision (None: stragglers are named only). Multi-node: `pace`
        gets this node's pace at each window closed (its ranks' median compute per step, and the
        fewest steps a rank completed), for node 0; `nodes`: node 0's judge of every node's pace
        (node_stragglers.py), ticked with this one; `solo`: the node has one rank, whose windows
        close alone (for its pace: there is no other rank to compare it with)."""
        self.factor, self.windows, self.window_s = factor, windows, window_s
        self.pace, self.nodes, self.solo = pace, nodes, solo
        self.write, self.warn = write, warn
        self.moves = moves or MoveOut(after_s=0)
        self.baseline: float | None = None  # the job's step time in the latest window nobody was slow in
        self._stretch: dict[int, list[float]] = {}  # rank -> [since, lost seconds] while slow in a row
        self.found: list[dict[str, Any]] = []  # every warning given, for the summary
        self._acc: dict[int, list[float]] = {}  # rank -> [steps, compute seconds] this window
        self._streaks = SlowStreaks(windows)
        self._window_start: float | None = None
        self._samples: dict[tuple[str, int], dict[str, Any]] = {}  # (gpu|host, rank) -> latest sample
        self._lock = threading.Lock()

    def add(self, rank: int, rec: Alive | Step, now: float) -> None:
        """An `alive` record's step timings (steps, compute_s), or a script's live session's `step` record's."""
        if self._window_start is None:
            self._window_start = now
        acc = self._acc.setdefault(rank, [0, 0.0])
        acc[0] += rec.steps or 0
        acc[1] += rec.compute_s or 0.0

    def sample(self, rec: dict[str, Any]) -> None:
        """Thread-safe: a GPU or host sample from the monitor, kept for the reasons."""
        if rec.get("type") in ("gpu", "host") and rec.get("rank") is not None:
            with self._lock:
                self._samples[(rec["type"], int(rec["rank"]))] = rec

    def tick(self, now: float) -> None:
        if self.nodes is not None:
            self.nodes.tick(now)
        if self.factor <= 0 or self._window_start is None or now - self._window_start < self.window_s:
            return
        if len(self._acc) < (1 if self.solo else 2) or min(steps for steps, _ in self._acc.values()) < MIN_STEPS:
            return  # slow steps: the window grows until every rank finished a few
        acc, self._acc, start, self._window_start = self._acc, {}, self._window_start, now
        per_step = {rank: compute / steps for rank, (steps, compute) in acc.items()}
        window = Window(start, now, per_step, {rank: int(steps) for rank, (steps, _) in acc.items()})
        if self.pace is not None:
            self.pace(statistics.median(per_step.values()), min(window.steps.values()))
        if len(per_step) < 2:
            return
        for rank, mine in per_step.items():
            others = statistics.median(v for r, v in per_step.items() if r != rank)
            slowdown = mine / others if others > 0 else 0.0
            if slowdown <= self.factor:
                self._end_stretch(rank, now, moved=False)
                self._streaks.clear(rank)
                continue
            due = self._streaks.slow(rank)
            self._cost(rank, window, mine, others)
            if due:
                self._report(rank, slowdown, mine, others)
        if all(window.slowdown(rank) <= self.factor for rank in per_step):
            self.baseline = window.step_s
        for moved in self.moves.window(window, self.baseline):
            line = after_line(moved)
            if line:
                logger.info(line)

    def _cost(self, rank: int, w: Window, mine: float, others: float) -> None:
        """What this window of `rank`'s pace took the job (counted once it is named): every step
        waited for its compute beyond the others' median."""
        stretch = self._stretch.setdefault(rank, [w.start, 0.0])
        stretch[1] += min(w.end - w.start, min(w.steps.values()) * max(0.0, mine - others))

    def _end_stretch(self, rank: int, now: float, moved: bool) -> None:
        since, lost = self._stretch.pop(rank, (None, 0.0))
        if since is not None and (rank in self._streaks.named or moved):
            self.write(marks.straggler(rank, since, now, lost, moved))

    @property
    def nodes_found(self) -> list[dict[str, Any]]:
        """Node 0's warnings of whole nodes slower than the others (none elsewhere)."""
        return self.nodes.found if self.nodes is not None else []

    def take_due(self) -> list[Due]:
        """The ranks due for a move-out (straggler_moves.py), for the supervision to act on."""
        return self.moves.take()

    def moved(self, due: Due, now: float) -> dict[str, Any]:
        """`due`'s rank was moved out live: its stretch ends here; its evidence (the recovery's
        `straggler`) is filled in as the next windows close."""
        self._end_stretch(due.rank, now, moved=True)
        self._streaks.clear(due.rank)
        return self.moves.moved(due)

    def close(self, now: float) -> None:
        """The attempt ended: a named rank's (or, on node 0, node's) stretch ends with it."""
        for rank in list(self._stretch):
            self._end_stretch(rank, now, moved=False)
        if self.nodes is not None:
            self.nodes.close(now)

    def _report(self, rank: int, slowdown: float, mine: float, others: float) -> None:
        with self._lock:
            gpu, host = self._samples.get(("gpu", rank)), self._samples.get(("host", rank))
            others_cpu = [s["cpu_percent"] for (kind, r), s in self._samples.items()
                          if kind == "host" and r != rank and isinstance(s.get("cpu_percent"), (int, float))]
        reason = likely_reason(gpu, host, others_cpu)
        seconds = self.windows * self.window_s
        self.warn(f"straggler: rank {rank} computes {slowdown:.2f}x slower than the median of the other ranks "
                  f"({1000 * mine:.0f} ms vs {1000 * others:.0f} ms per step, for the last {seconds:.0f} s); "
                  + (f"likely reason: {reason}" if reason else "no reason visible in the GPU/host samples")
                  + "; the other ranks wait for it at every step")
        record = {"type": "straggler", "time": time.time(), "rank": rank, "slowdown": round(slowdown, 3),
                  "compute_ms": round(1000 * mine, 2), "others_ms": round(1000 * others, 2),
                  "windows": self.windows, "reason": reason}
        self.found.append(record)
        self.write(record)
