"""Viewers of a run's files: `gpuherd top` (live table) and `gpuherd report` (HTML + PNG).

They read `logs/<run-id>/` only (metrics.jsonl, summary.json, config.json,
supervisor.log, the worker log names) and never contact the supervisor or the
workers, so they work on a live run, a finished one, or a copy of its directory.

  run_files.py    the files, read while the run may still write them (both viewers)
  summary_file.py summary.json's fields the viewers use, each checked; what is not readable skipped
  events.py       what happened, as one list of events (both viewers)
  top_state.py    what `top` shows of each rank, and its verdict; top.py draws it
  top_groups.py   over 32 ranks: one row per status with its rank set, and the worst ranks
  report_data.py  a whole run as series; figures.py plots them, report.py writes the page
"""

from typing import Any

from supervisor.views.run_files import RunFiles, resolve_run
from supervisor.views.top import watch
from supervisor.views.top_state import RunState

__all__ = ["RunFiles", "RunState", "report_after_run", "resolve_run", "watch", "write_report"]


def __getattr__(name: str) -> Any:
    """The report's names load matplotlib: only when they are asked for."""
    if name in ("write_report", "report_after_run", "ReportFiles"):
        from supervisor.views import report

        return getattr(report, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
