"""The report's figures (matplotlib, Agg, no pyplot state): each takes the runs to
compare and returns a finished Figure; `render` turns them into PNG bytes.

    loss        training loss (mean over ranks) and validation loss vs step, runs overlaid
    throughput  the job's tokens/s and each run's MFU vs step
    step_time   seconds per step for every rank: a straggler's line stands apart
    devices     GPU utilisation, memory, temperature, power vs time per GPU
                (a CPU run: each worker's CPU % and resident memory instead)
    Over MAX_LINES ranks or GPUs a panel draws their median and min-max band and the
    few with the highest mean instead of one line each (`many`).
    timeline    loss vs time above one row of events per run on the same time axis:
                attempts, restarts, NaN steps, checkpoints, evaluations, warnings, errors
"""

from __future__ import annotations

import io
from collections.abc import Callable

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np

from supervisor.views.goodput_figure import goodput_timeline
from supervisor.views.report_data import RunData

GIB = 1024**3
MAX_LINES = 16  # series drawn one line each; more are drawn as a band (`many`)
BINS = 200  # points along x of the band
WORST_LINES = 3
WIDTH = 10.0  # inches; at 100 dpi a 1000-pixel-wide PNG
RUN_STYLES = ("-", "--", ":", "-.")
EVENT_STYLE = {  # kind -> (marker, colour) on the timeline
    "checkpoint": ("s", "tab:green"), "eval": ("o", "tab:blue"), "restart": ("X", "tab:orange"),
    "recovery": ("P", "tab:olive"),
    "nan": ("*", "tab:red"), "error": ("v", "tab:red"), "xid": ("D", "tab:purple"),
    "ecc": ("D", "tab:purple"), "warning": ("^", "goldenrod"),
}


def _figure(rows: int, height: float) -> Figure:
    fig = Figure(figsize=(WIDTH, height), layout="constrained")
    FigureCanvasAgg(fig)
    fig.subplots(rows, 1, squeeze=False)
    return fig


def _label(runs: list[RunData], run: RunData, what: str = "") -> str:
    prefix = f"{run.run_id} " if len(runs) > 1 else ""
    return (prefix + what).strip() or run.run_id


def _finish(ax: Axes, why_empty: str, fontsize: str = "small", ncol: int = 1) -> None:
    """Grid and legend on a panel with lines; on one without, say why it is empty."""
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=fontsize, ncol=ncol)
    else:
        ax.text(0.5, 0.5, why_empty, ha="center", va="center", transform=ax.transAxes, color="gray")


def loss(runs: list[RunData]) -> Figure:
    fig = _figure(1, 4.0)
    ax = fig.axes[0]
    for i, run in enumerate(runs):
        style = RUN_STYLES[i % len(RUN_STYLES)]
        points = run.mean_loss_by_step()
        if points:
            ax.plot(*zip(*points, strict=True), style, color=f"C{i}", label=_label(runs, run, "train loss"))
        if run.evals:
            ax.plot([s for _, s, _ in run.evals], [v for _, _, v in run.evals], style, marker="o",
                    color=f"C{i}", alpha=0.6, label=_label(runs, run, "validation loss"))
    ax.set(title="Loss vs step", xlabel="step", ylabel="loss")
    _finish(ax, "no logged step yet")
    return fig


def throughput(runs: list[RunData]) -> Figure:
    fig = _figure(2, 5.5)
    tps_ax, mfu_ax = fig.axes
    for i, run in enumerate(runs):
        style = RUN_STYLES[i % len(RUN_STYLES)]
        points = run.total_tokens_per_s()
        if points:
            tps_ax.plot(*zip(*points, strict=True), style, color=f"C{i}", marker=".", label=_label(runs, run))
        mfu = [(p.step, 100 * p.mfu) for p in run.steps.get(min(run.steps, default=0), []) if p.mfu is not None]
        if mfu:
            mfu_ax.plot(*zip(*mfu, strict=True), style, color=f"C{i}", marker=".", label=_label(runs, run))
    tps_ax.set(title="Throughput vs step (all ranks)", ylabel="tokens/s")
    mfu_ax.set(title="MFU vs step (rank 0)", xlabel="step", ylabel="MFU %")
    _finish(tps_ax, "no logged step yet")
    _finish(mfu_ax, "MFU n/a: no known peak FLOP/s (CPU or unlisted GPU)")
    return fig


def many(ax: Axes, named: list[tuple[str, list[tuple[float, float]]]], style: str = "-", **kw) -> None:
    """One line per series, up to MAX_LINES of them; more (a 2,048-rank run): their median and
    their min-max band over the x axis, plus the WORST_LINES series with the highest mean on
    their own, so a straggler still stands apart and the figure stays as cheap as for 8 ranks."""
    named = [(label, points) for label, points in named if points]
    if len(named) <= MAX_LINES:
        for label, points in named:
            ax.plot(*zip(*points, strict=True), style, label=label, **kw)
        return
    x = np.array([p[0] for _, points in named for p in points], dtype=float)
    y = np.array([p[1] for _, points in named for p in points], dtype=float)
    edges = np.linspace(x.min(), x.max(), BINS + 1)
    which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, BINS - 1)
    order = np.lexsort((y, which))
    starts = np.searchsorted(which[order], np.arange(BINS))
    ends = np.searchsorted(which[order], np.arange(BINS), side="right")
    filled = ends > starts
    centres = ((edges[:-1] + edges[1:]) / 2)[filled]
    ys = y[order]
    low = np.array([ys[a] for a, b in zip(starts[filled], ends[filled], strict=True)])
    high = np.array([ys[b - 1] for a, b in zip(starts[filled], ends[filled], strict=True)])
    mid = np.array([np.median(ys[a:b]) for a, b in zip(starts[filled], ends[filled], strict=True)])
    ax.fill_between(centres, low, high, alpha=0.2, color=kw.get("color", "tab:blue"),
                    label=f"all {len(named)}: min-max")
    ax.plot(centres, mid, style, color=kw.get("color", "tab:blue"), label=f"all {len(named)}: median")
    worst = sorted(named, key=lambda item: -float(np.mean([p[1] for p in item[1]])))[:WORST_LINES]
    for label, points in worst:
        ax.plot(*zip(*points, strict=True), style, linewidth=0.8, label=f"{label} (highest mean)")


def step_time(runs: list[RunData]) -> Figure:
    fig = _figure(len(runs), 2.2 + 1.8 * len(runs))
    for ax, run in zip(fig.axes, runs, strict=True):
        many(ax, [(f"rank {rank} {run.devices.get(rank, '')}",
                   [(p.step, p.step_time) for p in points if p.step_time is not None])
                  for rank, points in sorted(run.steps.items())], marker=".")
        ax.set(title=f"Step time per rank{' - ' + run.run_id if len(runs) > 1 else ''}", ylabel="s / step")
        _finish(ax, "no step time (no logged step, or tokens/s unknown)", ncol=4)
    fig.axes[-1].set_xlabel("step")
    return fig


def devices(runs: list[RunData]) -> Figure:
    if not any(run.gpus for run in runs):
        return _hosts(runs)
    panels = (("util", "GPU utilisation %", 1), ("mem_used", "memory used (GiB)", GIB),
              ("temp", "temperature (C)", 1), ("power_w", "power (W)", 1))
    fig = _figure(len(panels), 9.0)
    for ax, (key, title, scale) in zip(fig.axes, panels, strict=True):
        for i, run in enumerate(runs):
            many(ax, [(_label(runs, run, f"GPU{gpu}" + (f" (rank {samples[-1].rank})"
                                                         if samples[-1].rank is not None else "")),
                       [(run.since_start(s.time), getattr(s, key) / scale) for s in samples
                        if isinstance(getattr(s, key), float)])
                      for gpu, samples in sorted(run.gpus.items())], RUN_STYLES[i % len(RUN_STYLES)])
        ax.set(title=title, ylabel=title.split(" (")[0])
        _finish(ax, "n/a on these GPUs", "x-small", ncol=4)
    fig.axes[-1].set_xlabel("seconds since the run started")
    return fig


def _hosts(runs: list[RunData]) -> Figure:
    fig = _figure(2, 5.5)
    cpu_ax, rss_ax = fig.axes
    for i, run in enumerate(runs):
        style = RUN_STYLES[i % len(RUN_STYLES)]
        for ax, key, scale in ((cpu_ax, "cpu_percent", 1), (rss_ax, "rss", GIB)):
            many(ax, [(_label(runs, run, f"rank {rank} {run.devices.get(rank, '')}"),
                       [(run.since_start(s.time), (getattr(s, key) or 0) / scale) for s in samples])
                      for rank, samples in sorted(run.hosts.items())], style)
    cpu_ax.set(title="No GPU samples in this run: CPU % per worker process", ylabel="CPU %")
    rss_ax.set(title="Resident memory per worker process", xlabel="seconds since the run started", ylabel="GiB")
    for ax in (cpu_ax, rss_ax):
        _finish(ax, "no host samples", "x-small", ncol=4)
    return fig


def timeline(runs: list[RunData]) -> Figure:
    fig = Figure(figsize=(WIDTH, 3.2 + 1.3 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1 + len(runs), 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [3] + [1.2] * len(runs)})[:, 0]
    for i, run in enumerate(runs):
        for rank, points in sorted(run.steps.items())[:1]:  # rank 0's curve: the others overlap it
            axes[0].plot([run.since_start(p.time) for p in points], [p.loss for p in points],
                         RUN_STYLES[i % len(RUN_STYLES)], color=f"C{i}", label=_label(runs, run, f"loss (rank {rank})"))
        _events_row(axes[1 + i], run)
    axes[0].set(title="Loss and events vs time", ylabel="loss")
    _finish(axes[0], "no logged step yet")
    axes[-1].set_xlabel("seconds since the run started")
    return fig


def _events_row(ax: Axes, run: RunData) -> None:
    for span in run.attempts:
        colour = "tab:green" if span.outcome == "success" else "lightgray" if span.outcome == "running" else "salmon"
        ax.broken_barh([(run.since_start(span.start), max(span.end - span.start, 1e-3))], (-0.4, 0.8),
                       color=colour, alpha=0.35)
        ax.text(run.since_start(span.start), 0.45, f"attempt {span.attempt}: {span.outcome}", fontsize="x-small")
    by_kind: dict[str, list[float]] = {}
    for event in run.events:
        by_kind.setdefault(event.kind, []).append(run.since_start(event.time))
    for kind, times in by_kind.items():  # one artist per kind, however many events
        marker, colour = EVENT_STYLE.get(kind, ("|", "black"))
        ax.plot(times, [0] * len(times), marker=marker, color=colour, linestyle="none", markersize=9, label=kind)
    seen = set(by_kind)
    ax.set(ylim=(-1, 1), yticks=[], ylabel=run.run_id[-9:])
    if seen:
        ax.legend(fontsize="x-small", ncol=len(seen), loc="lower right")


FIGURES: dict[str, tuple[str, Callable[[list[RunData]], Figure]]] = {
    "loss": ("Loss and validation loss", loss),
    "throughput": ("Tokens/s and MFU", throughput),
    "step_time": ("Step time per rank", step_time),
    "devices": ("GPUs over time", devices),
    "timeline": ("Event timeline", timeline),
    "goodput": ("Goodput timeline: productive time and badput by cause", goodput_timeline),
}


def render(runs: list[RunData]) -> dict[str, bytes]:
    """name -> PNG bytes, in the report's order."""
    out = {}
    for name, (_title, make) in FIGURES.items():
        fig = make(runs)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        out[name] = buffer.getvalue()
    return out
