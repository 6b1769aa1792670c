"""The typed timeline the accounting reads: each `metrics.jsonl` record it needs, decoded once.

Worker records (`phase`, `step`, `checkpoint`) place the loop; the supervisor's own
`timeline` records mark what the workers cannot see: a start of the supervisor (the first
one, or a SLURM requeue/resubmission continuing the run), each attempt's spawn and end (with
the moment the failure was known), and a rank the kernel shows stopped (state T) or running
again; `recovery` records close a live recovery. Anything else is skipped, and so is a
record with a field of the wrong type: a script writes records too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

KINDS = ("phase", "step", "checkpoint", "timeline", "recovery")
WANTED = tuple(f'"type":"{kind}"'.encode() for kind in KINDS)  # records are compact JSON (status_channel)


@dataclass(frozen=True)
class Event:
    time: float  # wall clock (time.time()), as every record carries it
    kind: str  # phase | step | checkpoint | start | attempt | attempt_end | proc | recovery
    rank: int | None = None
    name: str | None = None  # a phase's name; a proc event's state letter
    step: int | None = None  # step / checkpoint step; an attempt's number; a recovery's steps redone
    value: float | None = None  # start: dataset build seconds; attempt_end: failed_at; recovery: seconds
    flag: bool = False  # attempt: resumed from a checkpoint; recovery: recovered


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def decode(record: Any) -> Event | None:
    """One record -> an Event, or None when the accounting does not use it."""
    if not isinstance(record, dict) or record.get("type") not in KINDS:
        return None
    t = _num(record.get("time"))
    if t is None:
        return None
    kind, rank = record["type"], _int(record.get("rank"))
    if kind == "phase":
        return Event(t, "phase", rank, name=str(record.get("name")))
    if kind in ("step", "checkpoint"):
        return Event(t, kind, rank, step=_int(record.get("step")))
    if kind == "recovery":
        if record.get("outcome") not in ("recovered", "failed"):
            return None
        return Event(t, "recovery", _int(record.get("rank")), step=_int(record.get("steps_redone")),
                     value=_num(record.get("seconds")), flag=record.get("outcome") == "recovered")
    event = record.get("event")
    if event == "start":
        return Event(t, "start", step=_int(record.get("start")), value=_num(record.get("dataset_s")))
    if event == "attempt":
        return Event(t, "attempt", step=_int(record.get("attempt")), flag=record.get("resumed") is True)
    if event == "attempt_end":
        return Event(t, "attempt_end", step=_int(record.get("attempt")), value=_num(record.get("failed_at")))
    if event == "proc" and rank is not None:
        return Event(t, "proc", rank, name=str(record.get("state")))
    return None


def decode_all(records: Iterable[Any]) -> list[Event]:
    return [e for r in records if (e := decode(r)) is not None]


def read_events(path: Path) -> list[Event]:
    """Every event of a `metrics.jsonl` (every start of the run: the file is appended to); a
    line cut short (a start killed mid-write) is skipped."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        if not any(k in line for k in WANTED):  # most lines are liveness and device samples: not parsed
            continue
        try:
            event = decode(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
        if event is not None:
            events.append(event)
    return events
