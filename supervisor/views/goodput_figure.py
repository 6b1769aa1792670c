"""`gpuherd report`'s goodput figure: one row per run, its wall time coloured by what it became
(productive, or the badput cause), from the supervisor's own accounting (supervisor/goodput)."""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from supervisor.goodput import CAUSES, PRODUCTIVE, painted, read_events
from supervisor.views.report_data import RunData

COLOURS = {PRODUCTIVE: "tab:green", "launch": "#9ecae1", "dataset": "#6baed6", "rendezvous": "#4292c6",
           "warmup": "#2171b5", "checkpoint_save": "tab:olive", "checkpoint_restore": "#bcbd22", "eval": "tab:cyan",
           "failure_detection": "tab:red", "restart": "tab:orange", "redone": "tab:pink", "sdc": "tab:brown", "stopped": "tab:purple",
           "straggler": "gold", "other": "lightgray"}


def goodput_timeline(runs: list[RunData]) -> Figure:
    """One row per run: wall time since the run began, coloured by what it became."""
    fig = Figure(figsize=(10.0, 3.0 + 0.8 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots(1, 1)
    seen: set[str] = set()
    for row, run in enumerate(runs):
        metrics = run.run_dir / "metrics.jsonl"
        events = [] if any(name.startswith(metrics.name) for name in run.not_read) else read_events(metrics)
        if not events:
            continue
        end = max(e.time for e in events)
        pieces = painted(events, end)
        for cause in (PRODUCTIVE, *CAUSES):
            bars = [(a - run.start, b - a) for a, b, label in pieces if label == cause and b > a]
            if bars:
                ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[cause])
                seen.add(cause)
    ax.set_yticks(range(len(runs)), [f"{r.run_id}\n{_ratio(r)}" for r in runs])
    ax.set_xlabel("seconds since the run began")
    if seen:
        ax.legend(handles=[Patch(color=COLOURS[c], label=c) for c in (PRODUCTIVE, *CAUSES) if c in seen],
                  fontsize="x-small", ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    else:
        ax.text(0.5, 0.5, "no training record", ha="center", va="center", transform=ax.transAxes, color="gray")
    return fig


def _ratio(run: RunData) -> str:
    block = (run.summary or {}).get("goodput")
    return f"goodput {block['ratio']:.2f}" if isinstance(block, dict) and "ratio" in block else ""
