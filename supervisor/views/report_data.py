"""One run's whole history as series, for the report's figures and tables.

`load_run` reads a run directory once (the same tolerant readers as `top`) and
groups metrics.jsonl into per-rank step series, validation losses, per-GPU and
per-worker samples, attempts and events. Times stay unix seconds; `since_start`
turns them into seconds since the run began, the report's shared time axis.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuherd.status_records import Checkpoint, Eval, Gpu, Host, Record, Restart, Step
from supervisor.views.events import Event, EventLog
from supervisor.views.run_files import RunFiles, RunFilesError, is_run_dir


@dataclass(frozen=True, slots=True)
class GpuPoint:
    """What the figures draw of a GPU sample: its other fields would only take memory."""

    time: float
    rank: int | None
    util: float | str | None
    mem_used: float | str | None
    temp: float | str | None
    power_w: float | str | None


@dataclass(frozen=True, slots=True)
class HostPoint:
    """What the figures draw of a host sample."""

    time: float
    cpu_percent: float | None
    rss: float | None


@dataclass(frozen=True, slots=True)
class StepPoint:
    time: float
    step: int
    loss: float
    tokens_per_s: float | None
    mfu: float | None
    step_time: float | None  # seconds per optimizer step (tokens per step / tokens/s)


@dataclass(frozen=True)
class Span:
    """One attempt: every worker started once (`--max-restarts`)."""

    attempt: int
    start: float
    end: float
    outcome: str


@dataclass
class RunData:
    run_dir: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    start: float
    steps: dict[int, list[StepPoint]] = field(default_factory=dict)  # rank -> logged steps
    evals: list[tuple[float, int, float]] = field(default_factory=list)  # (time, step, val_loss)
    gpus: dict[int, list[GpuPoint]] = field(default_factory=dict)  # GPU index -> samples
    hosts: dict[int, list[HostPoint]] = field(default_factory=dict)  # rank -> host samples
    events: list[Event] = field(default_factory=list)
    saves: list[Checkpoint] = field(default_factory=list)  # `checkpoint` records with their costs
    attempts: list[Span] = field(default_factory=list)
    devices: dict[int, str] = field(default_factory=dict)  # rank -> GPU3 / CPU0
    malformed: int = 0
    summary_skipped: list[str] = field(default_factory=list)  # summary.json's unreadable fields (summary_file.py)
    not_read: list[str] = field(default_factory=list)  # metrics.jsonl / supervisor.log when no regular file

    @property
    def run_id(self) -> str:
        return self.run_dir.name

    def since_start(self, when: float) -> float:
        return when - self.start

    def mean_loss_by_step(self) -> list[tuple[int, float]]:
        """The loss every rank logged at a step, averaged: each rank sees its own batch."""
        by_step: dict[int, list[float]] = {}
        for points in self.steps.values():
            for p in points:
                by_step.setdefault(p.step, []).append(p.loss)
        return [(step, statistics.fmean(losses)) for step, losses in sorted(by_step.items())]

    def total_tokens_per_s(self) -> list[tuple[int, float]]:
        """The job's throughput per logged step: every rank's tokens/s added up."""
        by_step: dict[int, float] = {}
        for points in self.steps.values():
            for p in points:
                if p.tokens_per_s is not None:
                    by_step[p.step] = by_step.get(p.step, 0.0) + p.tokens_per_s
        return sorted(by_step.items())


def load_run(run_dir: Path) -> RunData:
    """Read one run directory; RunFilesError (exit 2) when it is no run."""
    if not is_run_dir(run_dir):
        raise RunFilesError(f"{run_dir} is not a gpuherd run directory (no config.json, metrics.jsonl or summary.json)")
    files = RunFiles(run_dir, keep_records=False)  # each record is folded into the series as it is read
    data = RunData(run_dir=run_dir, config={}, summary=None, start=0.0)
    per_step: int | None = None
    seen_evals: set[int | None] = set()
    log = EventLog()
    restarts: list[float] = []
    last = None
    for r in files.poll_each():
        if per_step is None:
            per_step = tokens_per_step(files.config or {})
        _add(data, r, per_step, seen_evals)
        log.add(r)
        when = r.time
        if when is not None:
            last = when if last is None else max(last, when)
            if isinstance(r, Restart):
                restarts.append(when)
    log.add_warnings(files.warnings)
    data.config, data.summary, data.start = files.config or {}, files.summary, _start(files)
    data.devices, data.malformed, data.events = files.devices, files.malformed, log.events()
    data.summary_skipped, data.not_read = files.summary_file.skipped, files.not_read
    data.attempts = _attempts(data, restarts, data.start if last is None else last)
    return data


def _add(data: RunData, r: Record, per_step: int | None, seen_evals: set[int | None]) -> None:
    when, rank = r.time, r.rank
    if when is None:
        return
    match r:
        case Step(loss=float(loss)) if rank is not None:
            tps = r.tokens_per_s
            step_time = per_step / tps if per_step and tps is not None and tps > 0 else None
            data.steps.setdefault(rank, []).append(StepPoint(when, r.step or 0, loss, tps, r.mfu, step_time))
        case Eval(val_loss=float(val_loss)) if r.step not in seen_evals:
            seen_evals.add(r.step)
            data.evals.append((when, r.step or 0, val_loss))
        case Checkpoint(stall_s=float()):
            data.saves.append(r)
        case Gpu(gpu=int(gpu)):
            data.gpus.setdefault(gpu, []).append(GpuPoint(when, rank, r.util, r.mem_used, r.temp, r.power_w))
        case Host() if rank is not None:
            data.hosts.setdefault(rank, []).append(HostPoint(when, r.cpu_percent, r.rss))


def tokens_per_step(cfg: dict[str, Any]) -> int | None:
    """Tokens one rank trains on per optimizer step, from the run's config.json (None where it
    does not hold them as positive whole numbers)."""
    try:
        factors = (cfg["training"]["batch_size"], cfg["training"]["grad_accum_nums"], cfg["data"]["context_length"])
    except (KeyError, TypeError):
        return None
    if not all(type(f) is int and f > 0 for f in factors):
        return None
    return factors[0] * factors[1] * factors[2]


def _start(files: RunFiles) -> float:
    started = (files.summary or {}).get("started_at")
    if isinstance(started, str):
        try:
            return datetime.datetime.fromisoformat(started).timestamp()
        except ValueError:
            pass
    return files.started()


def _attempts(data: RunData, restarts: list[float], end: float) -> list[Span]:
    """summary.json's attempts when the run has ended; else one open span per restart record."""
    spans = []
    for a in (data.summary or {}).get("attempts", []):
        try:
            begin = datetime.datetime.fromisoformat(a["started_at"]).timestamp()
            spans.append(Span(int(a["attempt"]), begin, begin + float(a["duration_s"]), str(a.get("outcome"))))
        except (KeyError, TypeError, ValueError):
            continue
    if spans:
        return spans
    starts = [data.start] + restarts
    return [Span(i, s, starts[i + 1] if i + 1 < len(starts) else end, "running" if i == len(starts) - 1 else "failed")
            for i, s in enumerate(starts)]
