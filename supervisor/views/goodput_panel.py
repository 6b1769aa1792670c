"""Goodput in `gpuherd top`: one line, the run's so far and over the last 5 and 15 minutes.

Fed the records `top` reads anyway (metrics.jsonl), typed once by `RunFiles` as every panel
gets them, and computed by the supervisor's own accounting (supervisor/goodput), so the number
is the one summary.json will hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text

from gpuherd.status_records import Record
from supervisor.goodput import Event, Goodput, account, console_line, event_of

WINDOWS_S = (300.0, 900.0)


@dataclass
class GoodputTrack:
    """Fed every record `top` reads; says the run's goodput so far."""

    events: list[Event] = field(default_factory=list)

    def observe(self, record: Record) -> None:
        event = event_of(record)
        if event is not None:
            self.events.append(event)

    def line(self, now: float | None = None, summary: dict[str, Any] | None = None) -> Text:
        """`summary`: the run's summary.json once it ended (its fields checked: views/summary_file.py):
        its goodput, and the windows end with the run, not with the clock."""
        if not self.events:
            return Text("goodput: no training record yet", style="dim")
        if summary is not None:
            end = max(e.time for e in self.events)
        else:
            end = time.time() if now is None else now
        block = (summary or {}).get("goodput")
        total = Goodput(**block) if block is not None else account(self.events, end)
        text = Text(console_line(total), style="bold")
        for window in WINDOWS_S:
            text.append(f"  last {window / 60:.0f} min {account(self.events, end, since=end - window).ratio:.2f}")
        return text
