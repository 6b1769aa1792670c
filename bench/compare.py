"""Side-by-side measurement: run A and B interleaved (A B A B ...) and report ratios.

Absolute times on a shared 2-core machine are noise; alternating both sides in one
run exposes them to the same noise, so the ratio of medians is what we record.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson


@dataclass
class Side:
    name: str
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)


@dataclass
class Comparison:
    what: str  # e.g. "teardown latency, 8 workers"
    unit: str  # e.g. "ms"
    ours: Side
    theirs: Side
    lower_is_better: bool = True

    @property
    def ratio(self) -> float:
        """How many times better ours is (>1 means gpuherd wins)."""
        a, b = self.ours.median, self.theirs.median
        if self.lower_is_better:
            return b / a if a > 0 else float("inf")
        return a / b if b > 0 else float("inf")

    def row(self) -> str:
        o, t = self.ours, self.theirs
        return (f"| {self.what} | {o.median:.3g} ({o.low:.3g}–{o.high:.3g}) {self.unit} | "
                f"{t.median:.3g} ({t.low:.3g}–{t.high:.3g}) {self.unit} | {self.ratio:.2f}× |")

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "ours_median": self.ours.median, "theirs_median": self.theirs.median}


def interleaved(what: str, unit: str, ours: tuple[str, Callable[[], float]], theirs: tuple[str, Callable[[], float]],
                repeats: int, lower_is_better: bool = True) -> Comparison:
    """Call each side's measure function `repeats` times, alternating which goes first."""
    a, b = Side(ours[0], []), Side(theirs[0], [])
    for i in range(repeats):
        order = ((ours[1], a), (theirs[1], b)) if i % 2 == 0 else ((theirs[1], b), (ours[1], a))
        for measure, side in order:
            side.samples.append(float(measure()))
    return Comparison(what, unit, a, b, lower_is_better)


@dataclass
class Tally:
    """Each side's samples by name, and how many of its runs did not finish (a None)."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, value: float | None) -> None:
        self.failed[key] = self.failed.get(key, 0) + (value is None)
        if value is not None:
            self.seconds.setdefault(key, []).append(value)

    def side(self, name: str) -> Side:
        return Side(name, self.seconds.get(name) or [float("nan")])

    def unfinished(self) -> str:
        return ", ".join(f"{key} {count}" for key, count in sorted(self.failed.items()))


def rotated(sides: list[Callable[[], None]], rounds: int) -> list[float]:
    """Run every side once a round, the order rotating by one each round (no side always runs
    first, on a machine that warms up or fills up); the 1-minute load average before the first
    and after every side."""
    load = [os.getloadavg()[0]]
    for i in range(rounds):
        for side in sides[i % len(sides):] + sides[:i % len(sides)]:
            side()
            load.append(os.getloadavg()[0])
    return load


def write_results(name: str, title: str, comparisons: list[Comparison], notes: list[str] = (),
                  extra_rows: list[str] = ()) -> None:
    """bench/results/<name>.md (+ .json), the format `python -m bench` collects; each row is
    printed too, so a run shows its results as they come."""
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(parents=True, exist_ok=True)
    if comparisons:
        ours = comparisons[0].ours.name
        others = {c.theirs.name for c in comparisons}
        theirs = others.pop() if len(others) == 1 else "other launcher (named in the row)"
        lines = [f"**{title}**", "", f"| measure | {ours} median (min–max) | {theirs} median (min–max) | {ours} advantage |",
                 "|---|---|---|---|", *(c.row() for c in comparisons)]
    else:
        lines = [f"**{title}**", ""]
    lines += list(extra_rows)
    if notes:
        lines += ["", *(f"- {n}" for n in notes)]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_bytes(orjson.dumps(
        {"title": title, "comparisons": [c.to_json() for c in comparisons], "notes": list(notes)},
        option=orjson.OPT_INDENT_2))
    for c in comparisons:
        print(c.row())
