"""`gpuherd report RUN [RUN ...]`: one self-contained HTML page plus the same figures as PNG.

Sections: the runs (outcome, exit code, root cause, duration, steps, final loss and
validation loss, tokens/s, restarts), the config (differences between compared
runs, or the key settings of one run), the figures (`figures.py`) and every event.
The PNGs are embedded as base64, so report.html opens offline, mailed or copied.

Written into `<run>/report/` for one run and `<first run>/report-vs-<other ids>/`
for a comparison; every file atomically, and only after every run was read.
"""

from __future__ import annotations

import base64
import datetime
import html
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from gpuherd.files import write_bytes_atomic
from supervisor.output import rank_set
from supervisor.summary import moved_out_line
from supervisor.views import figures
from supervisor.views.report_data import RunData, load_run
from supervisor.views.top import clock

MAX_LISTED = 32  # workers named one by one; more are counted
KEY_SETTINGS = ("preset", "model.n_layers", "model.dim", "model.n_heads", "training.strategy",
                "training.batch_size", "training.grad_accum_nums", "training.learning_rate",
                "training.max_steps", "data.dataset", "data.context_length", "system.max_restarts")
CSS = """body{font-family:sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;font-size:90%}
th{background:#f0f0f0}.fail{color:#b00;font-weight:bold}.ok{color:#070}img{max-width:100%;border:1px solid #ddd}"""


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    figures: dict[str, Path]  # figure name -> PNG


def default_out_dir(run_dirs: Sequence[Path]) -> Path:
    first = Path(run_dirs[0])
    if len(run_dirs) == 1:
        return first / "report"
    return first / ("report-vs-" + "+".join(Path(d).name for d in run_dirs[1:]))[:120]


def write_report(run_dirs: Sequence[Path], out_dir: Path | None = None) -> ReportFiles:
    """Read every run (RunFilesError, exit 2, for one that is no run), draw, then write."""
    runs = [load_run(Path(d)) for d in run_dirs]
    pngs = figures.render(runs)
    page = render_html(runs, pngs)
    out = Path(out_dir) if out_dir is not None else default_out_dir([r.run_dir for r in runs])
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, data in pngs.items():
        written[name] = out / f"{name}.png"
        write_bytes_atomic(written[name], data)
    write_bytes_atomic(out / "report.html", page.encode())
    return ReportFiles(out / "report.html", written)


def report_after_run(run_dir: Path) -> Path | None:
    """The automatic report at the end of a run: a failure here is a warning, never
    the run's exit code (the run's own files are what matters)."""
    try:
        return write_report([run_dir]).html
    except Exception as exc:  # plotting must never turn a finished run into a failed one
        logger.warning(f"could not write the run report: {exc!r} (try: gpuherd report {run_dir})")
        return None


def render_html(runs: list[RunData], pngs: dict[str, bytes]) -> str:
    title = "gpuherd report: " + " vs ".join(r.run_id for r in runs)
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
             f"<style>{CSS}</style></head><body><h1>{_e(title)}</h1>",
             f"<p>written {datetime.datetime.now():%Y-%m-%d %H:%M:%S} from "
             f"{_e(', '.join(str(r.run_dir) for r in runs))}</p>",
             "<h2>Runs</h2>", _table(["", *[r.run_id for r in runs]], _numbers(runs))]
    parts += _causes(runs)
    diff = config_diff([r.config for r in runs])
    heading = "Config differences" if len(runs) > 1 else "Key settings"
    rows = diff if len(runs) > 1 else [[k, *_values(runs, k)] for k in KEY_SETTINGS]
    parts += [f"<h2>{heading}</h2>", _table(["setting", *[r.run_id for r in runs]], rows) if rows else
              "<p>the compared runs have the same config</p>"]
    for name, (caption, _make) in figures.FIGURES.items():
        data = base64.b64encode(pngs[name]).decode()
        parts.append(f"<h2>{_e(caption)}</h2>"
                     f"<img id='fig-{name}' alt='{_e(caption)}' src='data:image/png;base64,{data}'>")
    parts += ["<h2>Events</h2>", _events(runs), "</body></html>"]
    return "\n".join(parts)


def _numbers(runs: list[RunData]) -> list[list[str]]:
    def row(label: str, fn) -> list[str]:
        return [label, *[fn(r) for r in runs]]

    return [
        row("outcome", lambda r: _outcome(r)),
        row("exit code", lambda r: str((r.summary or {}).get("exit_code", "-"))),
        row("duration", lambda r: clock(r.summary["duration_s"]) if r.summary and "duration_s" in r.summary else "-"),
        row("workers", _workers),
        row("last step", lambda r: str(max((p.step for ps in r.steps.values() for p in ps), default="-"))),
        row("final loss", lambda r: _f(r.mean_loss_by_step()[-1][1] if r.mean_loss_by_step() else None)),
        row("final validation loss", lambda r: _f(r.evals[-1][2] if r.evals else None)),
        row("median tokens/s (all ranks)", lambda r: _f(_median([v for _, v in r.total_tokens_per_s()]), ",.0f")),
        row("restarts", lambda r: str((r.summary or {}).get("restarts", max(0, len(r.attempts) - 1)))),
        row("checkpoint cost (median per save)", _save_costs),
        row("suspect devices", _suspects),
        row("stragglers moved out", lambda r: "; ".join(moved_out_line(rec) for rec in (r.summary or {}).get(
            "recoveries") or [] if rec.get("straggler") and rec.get("outcome") == "recovered") or "-"),
        row("events", lambda r: ", ".join(f"{n} {k}" for k, n in _counts(r).items()) or "-"),
        row("unreadable lines in metrics.jsonl (skipped)", lambda r: str(r.malformed)),
        row("files not read (no regular file)", lambda r: ", ".join(r.not_read) or "-"),
        row("unreadable fields in summary.json (skipped)",
            lambda r: f"{len(r.summary_skipped)}: {', '.join(r.summary_skipped)}" if r.summary_skipped else "0"),
    ]


def _workers(run: RunData) -> str:
    """`GPU0 (rank 0), GPU1 (rank 1)`; a large run: how many, and the rank set (the console's form)."""
    if len(run.devices) <= MAX_LISTED:
        return ", ".join(f"{d} (rank {k})" for k, d in sorted(run.devices.items())) or "-"
    kinds = sorted({d.rstrip("0123456789") for d in run.devices.values()})
    return f"{len(run.devices):,} {'/'.join(kinds)} workers, ranks {rank_set.ranges(run.devices)}"


def _outcome(run: RunData) -> str:
    if run.summary is None:
        return "no summary.json (running, or the supervisor was killed)"
    return str(run.summary.get("outcome", "?"))


def _save_costs(run: RunData) -> str:
    """The loop's stall and the write per save, from the writing ranks' `checkpoint` records."""
    if not run.saves:
        return "-"
    background = [r for r in run.saves if r.mode == "async"]
    waits = [r for r in run.saves if r.wait_s]
    return (f"{len(run.saves)} saves: loop blocked {_median([r.stall_s for r in run.saves]):.3f} s, "
            f"write {_median([r.write_s or 0.0 for r in run.saves]):.2f} s; {len(background)} in the background"
            + (f", {len(waits)} waited for the previous write" if waits else ""))


def _suspects(run: RunData) -> str:
    """The devices blamed for transient faults (summary.json), and whether a restart left them out."""
    found = (run.summary or {}).get("suspect_devices") or []
    return "; ".join(
        f"{'GPU ' + str(d['gpu']) if d.get('gpu') is not None else d.get('device')} (rank {d.get('rank')}, "
        f"attempt {d.get('attempt')}: {d.get('transient_faults')} {d.get('cause', 'transient fault')}s, limit {d.get('limit')})"
        + (f", {d['then']}" if d.get("then") else "")
        + (f"; at steps {', '.join(map(str, d['steps']))}" if d.get("steps") else "")
        + (f"; {d['evidence'][0]}" if d.get("evidence") else "") for d in found) or "-"


def _causes(runs: list[RunData]) -> list[str]:
    out = []
    for run in runs:
        cause = (run.summary or {}).get("root_cause")
        if cause:
            tail = "".join(f"\n    {_e(line)}" for line in cause.get("stderr_tail") or [])
            out.append(f"<p class='fail'>{_e(run.run_id)}: root cause: {_e(cause.get('message', '?'))}</p>"
                       + (f"<pre>{tail}</pre>" if tail else ""))
    return (["<h2>Root cause</h2>"] + out) if out else []


def config_diff(configs: list[dict[str, Any]]) -> list[list[str]]:
    """[setting, value per run] for every dotted setting whose values differ."""
    flat = [_flatten(c) for c in configs]
    keys = sorted(set().union(*flat)) if flat else []
    return [[k, *[_show(f.get(k, "-")) for f in flat]] for k in keys if len({_show(f.get(k, "-")) for f in flat}) > 1]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _values(runs: list[RunData], key: str) -> list[str]:
    return [_show(_flatten(r.config).get(key, "-")) for r in runs]


def _events(runs: list[RunData]) -> str:
    rows = [[r.run_id, clock(r.since_start(e.time)), e.kind, e.text] for r in runs for e in r.events]
    return _table(["run", "at", "kind", "what"], rows) if rows else "<p>no events</p>"


def _counts(run: RunData) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in run.events:
        counts[event.kind] = counts.get(event.kind, 0) + 1
    return counts


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _f(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def _show(value: Any) -> str:
    return "null" if value is None else str(value)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)
