"""A whole node slower than the other nodes, named on node 0 while the job runs.

Each node's supervisor compares its own ranks with each other (stragglers.py), so a node whose
ranks are all slow alike (a host whose CPUs are throttled, a noisy neighbour on every core, a
slow link that every rank of the node waits on) looks even there. Every window it closes, each
node also sends its *pace*, the median of its ranks' compute per step, to node 0 (over the node
agents' direct connections, with the console lines: supervisor/output/cross_node.py's channel).
Node 0 judges each pace as it comes against the median of the other nodes' latest ones: a node
above `factor` in `windows` of its windows in a row gets one WARNING naming it and a
`straggler` record with `node` set (metrics.jsonl and the summary); back under the factor, it
may be named again later.

The other nodes' ranks wait for the slow node's in every collective, and that wait is not
compute: their pace stays what it was, the slow node's grows. A node whose pace has not come
for two windows (slow steps keep its window open, or it is gone) is no baseline for the others,
and its own count stands until its next pace.

Not moved: a spare node (`--spare-nodes`) takes only a node that died. Naming is what this
does; the ranks' own move-out (straggler_moves.py) still acts within each node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loguru import logger

from supervisor.health.stragglers import WINDOW_S, SlowStreaks

PACE = "pace"  # the key that marks a node's pace among the records relayed to node 0


def pace_record(compute_s: float, steps: int) -> dict[str, Any]:
    """What a node relays to node 0 at each of its windows: its ranks' median compute per step."""
    return {PACE: round(compute_s, 6), "steps": steps}


def read_pace(record: Any) -> tuple[float, int] | None:
    """(compute seconds per step, steps) of a relayed pace record; None for anything else."""
    if not isinstance(record, dict) or PACE not in record:
        return None
    pace, steps = record.get(PACE), record.get("steps")
    if isinstance(pace, bool) or not isinstance(pace, int | float) or pace < 0 \
            or isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        return None
    return float(pace), steps


@dataclass
class _Pace:
    compute_s: float  # median compute per step of the node's ranks, in its latest window
    at: float  # when node 0 received it (monotonic)


class NodeStragglers:
    def __init__(self, factor: float, windows: int, write: Callable[[dict[str, Any]], None],
                 window_s: float = WINDOW_S, warn: Callable[[str], None] = logger.warning) -> None:
        """`factor` 0: off (system.straggler_factor), as for ranks."""
        self.factor, self.windows, self.window_s = factor, windows, window_s
        self.write, self.warn = write, warn
        self.found: list[dict[str, Any]] = []  # every warning given, for the summary
        self._paces: dict[int, _Pace] = {}
        self._judged: dict[int, float] = {}  # node -> arrival time of its pace judged last
        self._streaks = SlowStreaks(windows)
        self._new = False  # a pace arrived since the last look (the supervision loop looks often)

    def add(self, node: int, compute_s: float, now: float) -> None:
        """Node `node`'s pace, as it arrived (from the agent link's reader thread: assignments only)."""
        self._paces[node] = _Pace(compute_s, now)
        self._new = True

    def tick(self, now: float) -> None:
        """Each node's pace that arrived since the last look is judged against the other nodes'
        recent ones (received within two windows: the nodes' windows close at their own moments)."""
        if self.factor <= 0 or not self._new:
            return
        self._new = False  # before the copy: a pace arriving meanwhile is looked at next time
        recent = {node: p for node, p in dict(self._paces).items() if now - p.at <= 2 * self.window_s}
        if len(recent) < 2:
            return
        for node, p in sorted(recent.items()):
            if p.at <= self._judged.get(node, float("-inf")):
                continue  # judged already: its count stands until its next window's pace
            self._judged[node] = p.at
            others = statistics.median(q.compute_s for n, q in recent.items() if n != node)
            slowdown = p.compute_s / others if others > 0 else 0.0
            if slowdown <= self.factor:
                self._streaks.clear(node)
            elif self._streaks.slow(node):
                self._report(node, slowdown, p.compute_s, others, {n: q.compute_s for n, q in recent.items()})

    def _report(self, node: int, slowdown: float, mine: float, others: float, paces: dict[int, float]) -> None:
        seconds = self.windows * self.window_s
        each = ", ".join(f"node {n} {1000 * v:.0f} ms" for n, v in sorted(paces.items()))
        self.warn(f"straggler: node {node} computes {slowdown:.2f}x slower than the median of the other nodes "
                  f"({1000 * mine:.0f} ms vs {1000 * others:.0f} ms per step, the median of each node's ranks, "
                  f"for the last {seconds:.0f} s: {each}); every other node's ranks wait for its ranks at every "
                  "step; not moved out: a spare node takes only a node that died")
        record = {"type": "straggler", "time": time.time(), "rank": None, "node": node,
                  "slowdown": round(slowdown, 3), "compute_ms": round(1000 * mine, 2),
                  "others_ms": round(1000 * others, 2), "windows": self.windows, "reason": None}
        self.found.append(record)
        self.write(record)
