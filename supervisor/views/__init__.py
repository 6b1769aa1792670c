"""Viewers of a run's files: `gpuherd top` (live table) and `gpuherd report` (HTML + PNG).

They read `logs/<run-id>/` only (metrics.jsonl, summary.json, config.json,
supervisor.log, the worker log names) and never contact the supervisor or the
workers, so they work on a live run, a finished one, or a copy of its directory.
"""

from typing import Any

from supervisor.views.run_files import RunFiles, resolve_run
from supervisor.views.run_state import RunState
from supervisor.views.top import watch

__all__ = ["RunFiles", "RunState", "report_after_run", "resolve_run", "watch", "write_report"]


def __getattr__(name: str) -> Any:
    """The report's names load matplotlib: only when they are asked for."""
    if name in ("write_report", "report_after_run", "ReportFiles"):
        from supervisor.views import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
