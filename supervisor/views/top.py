"""`gpuherd top`: a live terminal table of one run, one row per rank (rich).

    header   run id, outcome, elapsed, ETA, attempt / restarts
    table    rank, device, phase, step/max, loss, tok/s, MFU, step time, heartbeat age,
             GPU util, memory, temperature, power, SM clock (CPU workers: CPU %, RSS),
             status with the reason for a failed, stopped, silent or slow rank;
             over ROW_LIMIT ranks: one row per status with its rank set, and the worst
             ranks in full (top_groups.py; `--all-ranks` for every row)
    goodput  the run's so far, and over the last 5 and 15 minutes (views/goodput_panel.py)
    footer   the newest events: checkpoints, NaN steps, restarts, XIDs, warnings

It reads the run's files about once a second (`RunState.refresh`), never the
workers, so watching cannot slow or block a run; over SSH it needs nothing but an
ordinary terminal. Rich redraws the frame in place and leaves the last one on screen.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from supervisor.views import top_groups
from supervisor.views.top_state import RankView, RunState, RankVerdict

GIB = 1024**3
FOOTER_EVENTS = 6
ROW_LIMIT = 32  # ranks shown one row each; more are grouped by status
STYLE = {"failed": "bold white on red", "stopped": "bold white on red", "silent": "bold red",
         "slow": "bold yellow", "done": "green", "ended": "dim", "ok": ""}
COLUMNS = ("rank", "device", "phase", "step", "loss", "tok/s", "MFU", "step time", "beat",
           "util", "memory", "temp", "power", "clock", "status")


def frame(state: RunState, now: float | None = None, all_ranks: bool = False) -> Group:
    """One complete screen: header, the rank table, the event footer. More than ROW_LIMIT
    ranks (unless `all_ranks`): one row per status and the worst ranks instead (top_groups.py)."""
    now = time.time() if now is None else now
    verdicts = state.verdicts(now)
    if len(state.ranks) > ROW_LIMIT and not all_ranks:
        return Group(_header(state, now), top_groups.groups(state.ranks, verdicts, STYLE),
                     top_groups.worst(state.ranks, verdicts, COLUMNS, lambda v, vd: (_cells(v, vd, now),
                                                                                      STYLE.get(vd.level, ""))),
                     _footer(state))
    table = Table(*COLUMNS, expand=False, pad_edge=False, header_style="bold")
    for rank, view in sorted(state.ranks.items()):
        verdict = verdicts[rank]
        table.add_row(*_cells(view, verdict, now), style=STYLE.get(verdict.level, ""))
    if not state.ranks:
        table.add_row("-", "no worker has reported yet", *[""] * (len(COLUMNS) - 2))
    return Group(_header(state, now), state.goodput.line(now, state.files.summary), table, _footer(state))


def _header(state: RunState, now: float) -> Text:
    files, summary = state.files, state.files.summary or {}
    outcome = state.outcome(now)
    text = Text()
    text.append(f"gpuherd top  run {files.run_dir.name}  ", style="bold")
    text.append(outcome, style="bold green" if outcome.startswith("finished") else
                "bold" if outcome == "running" else "bold red")
    eta = state.eta()
    max_restarts = summary.get("max_restarts", _configured(files.config, "system", "max_restarts"))
    text.append(f"\nelapsed {clock(state.elapsed(now))}  ETA {clock(eta) if eta is not None else '-'}  "
                f"attempt {state.restarts + 1}  restarts {state.restarts}/{max_restarts}  {files.run_dir}")
    if files.malformed:
        text.append(f"\n{files.malformed} unreadable line(s) in metrics.jsonl skipped", style="yellow")
    if files.not_read:
        text.append(f"\nnot read, no regular file: {', '.join(files.not_read)}", style="yellow")
    if files.summary_file.skipped:
        text.append(f"\n{files.summary_file.skipped_line()}", style="yellow")
    return text


def _configured(config: dict[str, Any] | None, section: str, key: str) -> Any:
    """config.json's `section.key`, or `?` where the file does not hold it as a number."""
    value = (config or {}).get(section)
    value = value.get(key) if isinstance(value, dict) else None
    return value if type(value) is int else "?"


def _cells(view: RankView, verdict: RankVerdict, now: float) -> list[str]:
    step = "-" if view.step is None else f"{view.step}/{view.max_steps if view.max_steps is not None else '?'}"
    quiet = view.last_record is None or view.done or state_over(verdict)
    beat = "-" if quiet else f"{max(0.0, now - view.last_record):.0f}s"
    status = verdict.level.upper() if verdict.bad else verdict.level
    return [str(view.rank), view.device, view.phase or "-", step, _fmt(view.loss, ".4f"),
            _fmt(view.tokens_per_s, ",.0f"), _fmt(None if view.mfu is None else 100 * view.mfu, ".1f", "%"),
            _fmt(view.step_time, ".2f", "s"), beat, *_device_cells(view),
            f"{status}: {verdict.reason}" if verdict.reason else status]


def _device_cells(view: RankView) -> list[str]:
    """util, memory, temp, power, clock: the GPU's sample, or the process's CPU and RSS."""
    g = view.gpu
    if g is not None:
        used, total = g.mem_used, g.mem_total
        mem = f"{used / GIB:.1f}/{total / GIB:.0f}G" if isinstance(used, float) and isinstance(total, float) else "n/a"
        return [_fmt(g.util, ".0f", "%"), mem, _fmt(g.temp, ".0f", "C"),
                _fmt(g.power_w, ".0f", "W"), _fmt(g.sm_clock_mhz, ".0f", "MHz")]
    h = view.host
    if h is not None:
        return [_fmt(h.cpu_percent, ".0f", "% cpu"), _size(h.rss) + " rss", "-", "-", "-"]
    return ["-"] * 5


def _footer(state: RunState) -> Text:
    events = state.events()[-FOOTER_EVENTS:]
    text = Text("last events:" if events else "last events: none yet", style="bold")
    for event in events:
        stamp = datetime.datetime.fromtimestamp(event.time).strftime("%H:%M:%S") if event.time else "--:--:--"
        style = "red" if event.kind in ("nan", "error", "xid", "ecc") else "yellow" if event.kind in (
            "warning", "restart", "recovery") else ""
        text.append(f"\n  {stamp}  ", style="dim")
        text.append(event.text, style=style)
    return text


def state_over(verdict: RankVerdict) -> bool:
    """A rank that has ended: its heartbeat age means nothing any more."""
    return verdict.level in ("done", "ended", "failed")


def _size(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value / GIB:.1f}G" if value >= GIB else f"{value / 1024**2:.0f}M"


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return f"{value:{spec}}{unit}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def clock(seconds: float) -> str:
    """`0:37`, `12:05`, `1:02:03`."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def watch(state: RunState, console: Console, once: bool = False, interval: float = 1.0,
          all_ranks: bool = False) -> None:
    """Redraw every `interval` seconds until the run has ended, then leave the final
    frame on screen; `once`: print a single frame and return."""
    state.refresh()
    if once or state.finished or state.abandoned():
        console.print(frame(state, all_ranks=all_ranks))
        return
    with Live(frame(state, all_ranks=all_ranks), console=console, auto_refresh=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        while True:
            time.sleep(interval)
            state.refresh()
            live.update(frame(state, all_ranks=all_ranks), refresh=True)
            if state.finished or state.abandoned():
                return
