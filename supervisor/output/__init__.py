"""Worker output -> `GPUn:`-prefixed whole lines on the console and in one file per worker.

  LogRouter, WorkerLog (router.py): pipes -> lines -> console + files
  LineSplitter, Severity (lines.py): bytes -> whole lines, `\\r` progress, line severity
  Console, Collapser (console.py): the non-blocking console writer; rank filter, collapsing
"""

from supervisor.output.console import STDERR, STDOUT, Collapser, Console
from supervisor.output.lines import LineSplitter, Severity
from supervisor.output.router import LogRouter, WorkerLog

__all__ = ["STDERR", "STDOUT", "Collapser", "Console", "LineSplitter", "LogRouter", "Severity", "WorkerLog"]
