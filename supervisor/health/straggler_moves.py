"""When a straggler is moved out, and what its pace cost: the decision, from the straggler
windows (stragglers.py), with no process, pipe or clock of its own.

Each window closed gives every rank's compute per step and the job's wall time per step (the
window's length over the steps its slowest rank completed in it). A rank whose compute per
step stays above `factor` times the median of the other ranks' in every window for `after_s`
seconds is *due*, again at each window while that holds: the supervision (supervision.py)
moves it out live when a warm spare can take it, else names it only and says why (once per
reason: a spare that is warm by the next window takes it then). A rank is moved out once per
attempt: when its
replacement is slow too, the cause is not in its process (the host, a link), and a second
move-out would only cost a second pause.

The defaults act on no noise: a rank's compute in a 5 s window varies by a few percent on a
quiet machine and by up to about 1.5x on a host whose cores are shared with other jobs (the
8-rank, 10-minute run of bench/bench_straggler_move.py), so a move-out needs 2x in every
window for 30 s: six windows in a row, twice the 1.3x that only names a straggler. A shorter
slow-down (a checkpoint write on one host, a burst of other work) costs less than the move
itself: a warm spare's join and state transfer, a few seconds plus the step in flight.

Its pace, while a rank is named (stragglers.py's `factor` for `windows` windows, and on until
it is back under the factor, moved out, or the attempt ends), costs the job its compute beyond
the others' at every step: `lost_s` (the goodput account's `straggler` cause). After a move-out
the job's step time is measured again (`after`, the second window closed after the move: the
first holds the recovery's pause), and the time saved is counted on every window from then on:
the steps completed there at the straggler's pace, minus what they took. The replacement's own
pace is judged from that second window on too: in the first, its compute per step holds its
join (a script's newcomer runs the script from its start), which would read as a replacement
slow too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MOVE_FACTOR = 2.0  # compute per step this many times the others' median ...
MOVE_AFTER_S = 30.0  # ... in every window for this long: the rank is moved out (0: never)


@dataclass(frozen=True)
class Window:
    """One closed straggler window."""

    start: float  # monotonic seconds
    end: float
    per_step: dict[int, float]  # rank -> mean compute seconds per step
    steps: dict[int, int]  # rank -> steps completed in the window

    @property
    def step_s(self) -> float:
        """The job's wall time per step: every rank waits for the slowest."""
        return (self.end - self.start) / max(1, min(self.steps.values()))

    def slowdown(self, rank: int) -> float:
        others = sorted(v for r, v in self.per_step.items() if r != rank)
        if not others:
            return 0.0
        mid = len(others) // 2
        median = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        return self.per_step[rank] / median if median > 0 else 0.0


@dataclass
class Due:
    """A rank slower than the factor for the whole time: to be moved out (or named, and why not)."""

    rank: int
    slowdown: float  # in the latest window
    held_s: float  # how long it has been above the factor
    again: bool  # moved out once already in this attempt: its replacement is slow too
    evidence: dict[str, Any] = field(default_factory=dict)  # recoveries' `straggler` (summary.json)

    def message(self, factor: float) -> str:
        ev = self.evidence
        before = ", ".join(f"rank {r} {ms:.0f} ms" for r, ms in ev["compute_ms_before"].items())
        baseline = (f", {ev['baseline_step_s']:.3f} s before it slowed down" if ev.get("baseline_step_s") else "")
        return (f"straggler: rank {self.rank} computed {self.slowdown:.2f}x the median of the other ranks for "
                f"{self.held_s:.0f} s (over {factor:g}x in every window; compute per step: {before}); the job's "
                f"step took {ev['step_s_before']:.3f} s at its pace{baseline}")


class MoveOut:
    def __init__(self, factor: float = MOVE_FACTOR, after_s: float = MOVE_AFTER_S) -> None:
        """`after_s` 0: the decision is off (stragglers are named only)."""
        self.factor, self.after_s = factor, after_s
        self.due: list[Due] = []  # taken by the supervision
        self.pending: dict[int, Due] = {}  # SIGKILLed to be moved out: its recovery is to get the evidence
        self.moves: list[dict[str, Any]] = []  # every move-out's evidence (the recovery's `straggler`)
        self._since: dict[int, float] = {}  # rank -> start of its first window over the factor, in a row
        self.said: dict[int, str] = {}  # rank -> why it was not moved out, said once per stretch and reason
        self._moved: set[int] = set()
        self._settling: set[int] = set()  # moved out: its replacement's first window (its join) is not judged
        self._waiting: list[tuple[dict[str, Any], int]] = []  # a move's evidence, windows to skip before `after`
        self._counting: list[dict[str, Any]] = []  # moves whose time saved is counted

    def window(self, w: Window, baseline: float | None = None) -> list[dict[str, Any]]:
        """`baseline`: the job's step time in the latest window in which no rank was slow. Returns
        the moves whose `after` this window measured."""
        measured = self._after(w)
        if self.after_s <= 0 or len(w.per_step) < 2:
            return measured
        for rank in w.per_step:
            slowdown = w.slowdown(rank)
            if rank in self._settling:  # the newcomer's first steps: its join and start, not its pace
                self._settling.discard(rank)
                continue
            if slowdown <= self.factor:
                self._since.pop(rank, None)
                self.said.pop(rank, None)
                continue
            since = self._since.setdefault(rank, w.start)
            if w.end - since >= self.after_s:  # again at each window while it holds: a spare may be warm now
                self.due.append(Due(rank, slowdown, w.end - since, again=rank in self._moved, evidence={
                    "slowdown": round(slowdown, 3), "held_s": round(w.end - since, 1),
                    "compute_ms_before": _per_rank_ms(w),
                    "step_s_before": round(w.step_s, 4),
                    "baseline_step_s": round(baseline, 4) if baseline is not None else None}))
        return measured

    def take(self) -> list[Due]:
        due, self.due = self.due, []
        return due

    def moved(self, due: Due) -> dict[str, Any]:
        """`due` was moved out: its evidence, filled in later (`after`, `saved_s`) in place."""
        self._moved.add(due.rank)
        self._settling.add(due.rank)
        self._since.pop(due.rank, None)
        self.said.pop(due.rank, None)
        due.evidence.update(compute_ms_after=None, step_s_after=None, saved_s=0.0)
        self.moves.append(due.evidence)
        self._waiting.append((due.evidence, 1))
        return due.evidence

    def _after(self, w: Window) -> list[dict[str, Any]]:
        for ev in self._counting:
            ev["saved_s"] = round(ev["saved_s"] + min(w.steps.values()) * ev["step_s_before"] - (w.end - w.start), 3)
        waiting, self._waiting, measured = self._waiting, [], []
        for ev, skip in waiting:
            if skip > 0:
                self._waiting.append((ev, skip - 1))
                continue
            ev["compute_ms_after"] = _per_rank_ms(w)
            ev["step_s_after"] = round(w.step_s, 4)
            ev["saved_s"] = round(min(w.steps.values()) * ev["step_s_before"] - (w.end - w.start), 3)
            self._counting.append(ev)
            measured.append(ev)
        return measured


def _per_rank_ms(w: Window) -> dict[str, float]:
    """{"rank": compute ms per step}, by rank (JSON's keys are strings)."""
    return {str(r): round(1000 * v, 2) for r, v in sorted(w.per_step.items())}


def after_line(ev: dict[str, Any]) -> str | None:
    """The console's line on a move-out's outcome, once its `after` window closed."""
    if ev.get("step_s_after") is None:
        return None
    return (f"straggler moved out: the job's step takes {ev['step_s_after']:.3f} s now, "
            f"{ev['step_s_before']:.3f} s at the straggler's pace "
            f"({ev['step_s_before'] / ev['step_s_after']:.2f}x faster since)" if ev["step_s_after"] > 0 else None)

