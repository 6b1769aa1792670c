"""Worker output -> `GPUn:`-prefixed whole lines on the console and in one file per worker.

  LogRouter, WorkerLog (router.py): pipes -> lines -> console + files
  LineSplitter, Severity (lines.py): bytes -> whole lines, `\\r` progress, line severity
  Console, Collapser (console.py): the non-blocking console writer; rank filter, collapsing
  WorkerPipes (pipes.py): an attempt's pipes read from one selector: lines to the router,
    status records decoded and handed on
"""

from supervisor.output.console import STDERR, STDOUT, Collapser, Console
from supervisor.output.lines import LineSplitter, Severity
from supervisor.output.pipes import WorkerPipes
from supervisor.output.router import LogRouter, WorkerLog

__all__ = ["STDERR", "STDOUT", "Collapser", "Console", "LineSplitter", "LogRouter", "Severity", "WorkerLog",
           "WorkerPipes"]
