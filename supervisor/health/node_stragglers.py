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

A node whose pace stays above `move_factor` (system.straggler_move_factor, 2x) in every window
for `move_after_s` (system.straggler_move_after_s, 30 s: the ranks' move-out rule, chosen the
same way, straggler_moves.py) is handed to node 0's agent to be moved out (`move`): where a spare
node (`--spare-nodes`) stands by, the node is told to leave and the spare node takes its place
live, as for a node that died whole (supervisor/rendezvous/node_move_out.py); else the answer
says why not, once per slow stretch and reason, and it is asked again at its next window (a spare
node may stand by by then). A node is moved out once per attempt: the spare node in its place is
judged from its second window (its first holds its join). The move's evidence (every node's
pace before, the new node's after) is a `straggler` record with `moved_out` (summary.json
`stragglers`); the takeover itself is a live recovery (summary.json `recoveries`).
The ranks' own move-out (straggler_moves.py) still acts within each node.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loguru import logger

from supervisor.goodput import marks
from supervisor.health.straggler_moves import MOVE_AFTER_S, MOVE_FACTOR
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
    steps: int = 0  # the fewest steps a rank of the node completed in that window


class NodeStragglers:
    def __init__(self, factor: float, windows: int, write: Callable[[dict[str, Any]], None],
                 window_s: float = WINDOW_S, warn: Callable[[str], None] = logger.warning,
                 move_factor: float = MOVE_FACTOR, move_after_s: float = MOVE_AFTER_S,
                 info: Callable[[str], None] = logger.info) -> None:
        """`factor` 0: off (system.straggler_factor), as for ranks; `move_after_s` 0: never moved out."""
        self.factor, self.windows, self.window_s = factor, windows, window_s
        self.move_factor, self.move_after_s = move_factor, move_after_s
        self.write, self.warn, self.info = write, warn, info
        self.move: Callable[[int, str], None] | None = None  # node 0's agent: tell a node to leave (None: named only)
        self.found: list[dict[str, Any]] = []  # every warning given, and every move, for the summary
        self._paces: dict[int, _Pace] = {}
        self._judged: dict[int, float] = {}  # node -> arrival time of its pace judged last
        self._streaks = SlowStreaks(windows)
        self._new = False  # a pace arrived since the last look (the supervision loop looks often)
        self._since: dict[int, float] = {}  # node -> start of its first window over move_factor, in a row
        self._asked: dict[int, dict[str, Any]] = {}  # node -> the move's evidence, while its answer is due
        self._answers: list[tuple[int, str | None]] = []  # from the agent link's reader thread
        self._moved: set[int] = set()  # moved out in this attempt: never again (a spare node is it now)
        self._settling: set[int] = set()  # moved out: the new node's first pace (its join) is not judged
        self._after: dict[int, dict[str, Any]] = {}  # moved out: its evidence, until the new node's second pace
        self.said: dict[int, str] = {}  # node -> why it was not moved out, said once per stretch and reason
        self._stretch: dict[int, list[float]] = {}  # node -> [since, lost seconds] while slow in a row

    def add(self, node: int, compute_s: float, now: float, steps: int = 0) -> None:
        """Node `node`'s pace, as it arrived (from the agent link's reader thread: assignments only)."""
        self._paces[node] = _Pace(compute_s, now, steps)
        self._new = True

    def answered(self, node: int, why_not: str | None) -> None:
        """Node 0's agent's answer to a move (from the agent link's reader thread: a list append only)."""
        self._answers.append((node, why_not))

    def tick(self, now: float) -> None:
        """Each node's pace that arrived since the last look is judged against the other nodes'
        recent ones (received within two windows: the nodes' windows close at their own moments)."""
        while self._answers:
            self._answer(*self._answers.pop(0), now)
        if self.factor <= 0 or not self._new:
            return
        self._new = False  # before the copy: a pace arriving meanwhile is looked at next time
        recent = {node: p for node, p in dict(self._paces).items() if now - p.at <= 2 * self.window_s}
        if len(recent) < 2:
            return
        paces = {n: q.compute_s for n, q in recent.items()}  # once per look: the same for every node judged
        for node, p in sorted(recent.items()):
            if p.at <= self._judged.get(node, float("-inf")):
                continue  # judged already: its count stands until its next window's pace
            self._judged[node] = p.at
            others = statistics.median(v for n, v in paces.items() if n != node)
            slowdown = p.compute_s / others if others > 0 else 0.0
            if node in self._settling:  # the spare node now in a moved node's place: its join, not its pace
                self._settling.discard(node)
                continue
            if node in self._after:  # its second window: the move's outcome
                self._after.pop(node)["compute_ms_after"] = {str(n): round(1000 * v, 2) for n, v in sorted(paces.items())}
                self.info(f"straggler: node {node} moved out: its place computes {slowdown:.2f}x the other nodes' "
                          f"median now ({1000 * p.compute_s:.0f} ms vs {1000 * others:.0f} ms per step)")
            if slowdown <= self.factor:
                self._end_stretch(node, p.at, moved=False)
                self._streaks.clear(node)
            else:  # every other node's ranks waited for its compute beyond theirs at each of its steps
                stretch = self._stretch.setdefault(node, [p.at - self.window_s, 0.0])
                stretch[1] += min(self.window_s, p.steps * max(0.0, p.compute_s - others))
                if self._streaks.slow(node):
                    self._report(node, slowdown, p.compute_s, others, paces)
            self._consider_move(node, slowdown, p.at, paces, others)

    def _end_stretch(self, node: int, at: float, moved: bool) -> None:
        """A named (or moved) node's slow stretch ended: what its pace cost the job (the goodput
        account's `straggler` badput), as for a rank (stragglers.py)."""
        since, lost = self._stretch.pop(node, (None, 0.0))
        if since is not None and (node in self._streaks.named or moved):
            self.write(marks.straggler(None, since, at, lost, moved, node=node))

    def close(self, now: float) -> None:
        """The attempt ended: a named node's stretch ends with it."""
        for node in list(self._stretch):
            self._end_stretch(node, now, moved=False)

    def _consider_move(self, node: int, slowdown: float, at: float, paces: dict[int, float], others: float) -> None:
        """Over `move_factor` in every window for `move_after_s`: node 0's agent is asked to move it
        out (again at each window while that holds and no move was made)."""
        if self.move is None or self.move_after_s <= 0 or node in self._moved:
            return
        if slowdown <= self.move_factor:
            self._since.pop(node, None)
            self.said.pop(node, None)
            return
        since = self._since.setdefault(node, at - self.window_s)
        if at - since < self.move_after_s or node in self._asked:
            return
        each = ", ".join(f"node {n} {1000 * v:.0f} ms" for n, v in sorted(paces.items()))
        evidence = {"type": "straggler", "time": time.time(), "rank": None, "node": node, "moved_out": True,
                    "slowdown": round(slowdown, 3), "compute_ms": round(1000 * paces[node], 2),
                    "others_ms": round(1000 * others, 2), "held_s": round(at - since, 1),
                    "compute_ms_before": {str(n): round(1000 * v, 2) for n, v in sorted(paces.items())},
                    "compute_ms_after": None, "windows": self.windows, "reason": None}
        self._asked[node] = evidence
        self.move(node, f"node {node} computed {slowdown:.2f}x the median of the other nodes for {at - since:.0f} s "
                        f"(over {self.move_factor:g}x in every window; each node's ranks' median compute per step: "
                        f"{each})")

    def _answer(self, node: int, why_not: str | None, now: float) -> None:
        evidence = self._asked.pop(node, None)
        if evidence is None:
            return
        if why_not is not None:
            if self.said.get(node) != why_not:
                self.said[node] = why_not
                self.warn(f"straggler: node {node} not moved out: {why_not}")
            return
        self._moved.add(node)
        self._settling.add(node)
        self._since.pop(node, None)
        self._end_stretch(node, now, moved=True)
        self._streaks.clear(node)
        self._paces.pop(node, None)  # its pace is no baseline now: the spare node's comes next
        self._after[node] = evidence
        self.info(f"straggler: node {node} moved out: told to leave, a spare node takes its place live "
                  f"({evidence['slowdown']:.2f}x the other nodes' compute for {evidence['held_s']:.0f} s)")
        self.found.append(evidence)
        self.write(evidence)

    def _report(self, node: int, slowdown: float, mine: float, others: float, paces: dict[int, float]) -> None:
        seconds = self.windows * self.window_s
        each = ", ".join(f"node {n} {1000 * v:.0f} ms" for n, v in sorted(paces.items()))
        self.warn(f"straggler: node {node} computes {slowdown:.2f}x slower than the median of the other nodes "
                  f"({1000 * mine:.0f} ms vs {1000 * others:.0f} ms per step, the median of each node's ranks, "
                  f"for the last {seconds:.0f} s: {each}); every other node's ranks wait for its ranks at every "
                  "step" + (f"; moved out to a spare node if it stays over {self.move_factor:g}x for "
                            f"{self.move_after_s:g} s" if self.move is not None and self.move_after_s > 0 else ""))
        record = {"type": "straggler", "time": time.time(), "rank": None, "node": node,
                  "slowdown": round(slowdown, 3), "compute_ms": round(1000 * mine, 2),
                  "others_ms": round(1000 * others, 2), "windows": self.windows, "reason": None}
        self.found.append(record)
        self.write(record)
