"""`top` on a large run: one row per status with its rank set, then the worst ranks in full.

2,048 rows fit no screen and tell nobody anything; what matters is how many ranks are in
each state, which ones, how far apart their steps are, and the few ranks that hold the
job back. Rank sets use the compact form of the console (`r[0-16,18-2047]`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from rich.table import Table

from supervisor.output import rank_set
from supervisor.views.top_state import RankVerdict, RankView

ORDER = ("failed", "stopped", "silent", "slow", "ok", "done", "ended")  # worst first
GROUP_COLUMNS = ("status", "ranks", "which", "step", "loss (mean)", "tok/s (all)", "step time (median/max)",
                 "first reason")
WORST = 8  # ranks shown in full below the groups
RANK_SET_WIDTH = 60  # characters of a group's rank set before it is cut


def groups(views: dict[int, RankView], verdicts: dict[int, RankVerdict], style: dict[str, str]) -> Table:
    table = Table(*GROUP_COLUMNS, expand=False, pad_edge=False, header_style="bold")
    by_level: dict[str, list[int]] = {}
    for rank, verdict in verdicts.items():
        by_level.setdefault(verdict.level, []).append(rank)
    for level in sorted(by_level, key=lambda lv: ORDER.index(lv) if lv in ORDER else len(ORDER)):
        ranks = by_level[level]
        members = [views[r] for r in ranks]
        steps = [v.step for v in members if v.step is not None]
        losses = [v.loss for v in members if isinstance(v.loss, (int, float))]
        rates = [v.tokens_per_s for v in members if isinstance(v.tokens_per_s, (int, float))]
        times = [v.step_time for v in members if v.step_time]
        reason = next((verdicts[r].reason for r in ranks if verdicts[r].reason), "")
        table.add_row(level.upper() if verdicts[ranks[0]].bad else level, f"{len(ranks):,}", _cut(ranks),
                      _span(steps), _num(statistics.fmean(losses) if losses else None, ".4f"),
                      _num(sum(rates) if rates else None, ",.0f"),
                      f"{statistics.median(times):.2f}/{max(times):.2f}s" if times else "-",
                      (f"rank {next(r for r in ranks if verdicts[r].reason)}: {reason}" if reason else ""),
                      style=style.get(level, ""))
    return table


def worst(views: dict[int, RankView], verdicts: dict[int, RankVerdict], columns: tuple[str, ...],
          row: Callable[[RankView, RankVerdict], tuple[list[str], str]], count: int = WORST) -> Table:
    """The `count` ranks most worth a look, in today's per-rank columns: bad verdicts first
    (failed before slow), then the slowest step times, then the ranks furthest behind."""
    def badness(rank: int) -> tuple:
        view, level = views[rank], verdicts[rank].level
        rank_of_level = ORDER.index(level) if level in ORDER else len(ORDER)
        return (rank_of_level, -(view.step_time or 0.0), view.step if view.step is not None else -1, rank)

    chosen = sorted(verdicts, key=badness)[:count]
    table = Table(*columns, expand=False, pad_edge=False, header_style="bold",
                  title=f"the {len(chosen)} ranks most worth a look", title_justify="left")
    for rank in chosen:
        cells, style = row(views[rank], verdicts[rank])
        table.add_row(*cells, style=style)
    return table


def _cut(ranks: list[int]) -> str:
    text = f"r[{rank_set.ranges(ranks)}]"
    if len(text) <= RANK_SET_WIDTH:
        return text
    return text[:RANK_SET_WIDTH].rsplit(",", 1)[0] + ",...]"


def _span(steps: list[int]) -> str:
    if not steps:
        return "-"
    low, high = min(steps), max(steps)
    return str(low) if low == high else f"{low}-{high}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"
