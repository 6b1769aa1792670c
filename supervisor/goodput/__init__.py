"""Goodput: the share of a run's wall time that became training kept, and where the rest went.

Computed by the supervisor from what it already records in `metrics.jsonl` (status records,
its own `timeline` marks, live recoveries): no code in the user's script. docs/guide/goodput.md
defines the causes and their boundaries.
"""

from supervisor.goodput.account import CAUSES, PRODUCTIVE, Goodput, account, painted
from supervisor.goodput.line import console_line
from supervisor.goodput.tensorboard import GoodputScalars, last_step
from supervisor.goodput.timeline import Event, TimelineReader, decode, event_of, read_events

__all__ = ["CAUSES", "PRODUCTIVE", "Event", "Goodput", "GoodputScalars", "account", "console_line", "decode",
           "event_of", "last_step", "painted", "read_events", "TimelineReader"]
