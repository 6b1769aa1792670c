"""Worker output -> `GPUn:`-prefixed whole lines on the console and in one file per worker.

  LogRouter, WorkerLog (router.py): pipes -> lines -> console + files
  LineSplitter, Severity (lines.py): bytes -> whole lines, `\\r` progress, line severity
  Console (console.py): the non-blocking console writer
  LineFolder, Source (fold.py): lines several ranks print alike -> one line with the rank set
  FoldingPoint, Group (cross_node.py): a multi-node job's held lines merged across nodes on node 0
  NodeRelay (node_relay.py): what each node sends node 0 (those lines, its pace) and node 0's share-out
  rank_set.py: the compact rank-set spelling, `GPU[0-3,5]`, `n[0-255]/r[0-2047]`
  WorkerPipes (pipes.py): an attempt's pipes read from one selector: lines to the router,
    status records decoded and handed on
"""

from supervisor.output.console import STDERR, STDOUT, Console
from supervisor.output.cross_node import FoldingPoint, Group
from supervisor.output.fold import LineFolder, Source
from supervisor.output.lines import LineSplitter, Severity
from supervisor.output.node_relay import NodeRelay
from supervisor.output.pipes import WorkerPipes
from supervisor.output.router import LogRouter, WorkerLog

__all__ = ["STDERR", "STDOUT", "Console", "FoldingPoint", "Group", "LineFolder", "LineSplitter", "LogRouter", "NodeRelay", "Severity", "Source",
           "WorkerLog", "WorkerPipes"]
