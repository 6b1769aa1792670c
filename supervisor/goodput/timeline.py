"""The typed timeline the accounting reads: each `metrics.jsonl` record it needs, decoded once.

Worker records (`phase`, `step`, `checkpoint`) place the loop; the supervisor's own
`timeline` records mark what the workers cannot see: a start of the supervisor (the first
one, or a SLURM requeue/resubmission continuing the run), each attempt's spawn and end (with
the moment the failure was known), and a rank the kernel shows stopped (state T) or running
again, a named straggler's slow stretch ended (what its pace cost); `recovery` records close a
live recovery. Anything else is skipped; a field of the
wrong type was dropped at decoding (gpuherd/status_records.py): a script writes records too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuherd.status_records import (Checkpoint, Phase, Record, Recovery, Refusal, ScriptSave, Step, TimelineAttempt,
                                    TimelineAttemptEnd, TimelineProc, TimelineStart, TimelineStraggler, from_object)
from gpuherd.status_records import decode as decode_line

KINDS = ("phase", "step", "checkpoint", "script_save", "timeline", "recovery")
WANTED = tuple(f'"type":"{kind}"'.encode() for kind in KINDS)  # records are compact JSON (status_channel)


@dataclass(frozen=True)
class Event:
    time: float  # wall clock (time.time()), as every record carries it
    kind: str  # phase | step | checkpoint | script_save | start | attempt | attempt_end | proc | recovery | straggler
    rank: int | None = None
    # a phase's name; a proc event's state letter; a recovery's action (shrink, regrow, ...); attempt: `script`
    # for a --script's; attempt_end: its outcome (null: success)
    name: str | None = None
    step: int | None = None  # step / checkpoint step; an attempt's number; a recovery's steps redone
    value: float | None = None  # start: dataset build seconds; attempt_end: failed_at; recovery, script_save: seconds;
    #                             straggler: the seconds its pace cost the job
    flag: bool = False  # attempt: resumed from a checkpoint; recovery: recovered


def event_of(record: Record | Refusal) -> Event | None:
    """One decoded record -> an Event, or None when the accounting does not use it."""
    t = None if isinstance(record, Refusal) else record.time
    if t is None:
        return None
    match record:
        case Phase(rank=rank, name=name):
            return Event(t, "phase", rank, name=str(name))
        case Step(rank=rank, step=step):
            return Event(t, "step", rank, step=step)
        case Checkpoint(rank=rank, step=step):
            return Event(t, "checkpoint", rank, step=step)
        case ScriptSave(rank=rank, step=step):
            return Event(t, "script_save", rank, step=step, value=record.seconds)
        case Recovery(outcome="recovered" | "failed" as outcome):
            return Event(t, "recovery", record.rank, name=record.action, step=record.steps_redone,
                         value=record.seconds, flag=outcome == "recovered")
        case TimelineStart():
            return Event(t, "start", step=record.start, value=record.dataset_s)
        case TimelineAttempt():
            return Event(t, "attempt", name="script" if record.script else None, step=record.attempt,
                         flag=record.resumed)
        case TimelineAttemptEnd():
            return Event(t, "attempt_end", name=record.outcome, step=record.attempt, value=record.failed_at)
        case TimelineProc(rank=int(rank)):
            return Event(t, "proc", rank, name=str(record.state))
        case TimelineStraggler(lost_s=float(lost)) if record.rank is not None or record.node is not None:
            return Event(t, "straggler", record.rank, value=lost)  # a rank's stretch, or a whole node's
    return None


def decode(obj: Any) -> Event | None:
    """A parsed metrics.jsonl line (a dict) -> an Event, or None."""
    return event_of(from_object(obj, supervisor=True))


def decode_all(records: Iterable[Any]) -> list[Event]:
    return [e for r in records if (e := decode(r)) is not None]


def read_events(path: Path) -> list[Event]:
    """Every event of a `metrics.jsonl` (every start of the run: the file is appended to); a
    line cut short (a start killed mid-write) is skipped."""
    return TimelineReader(path).events()


class TimelineReader:
    """The events of a `metrics.jsonl` that grows while it is read: each call decodes only the
    lines appended since the previous one, a few MiB at a time. The supervisor asks at every
    restart and at the end of each start, and a long run's file holds millions of lines (a
    script's heartbeats, liveness and device samples): decoding all of it each time was a stall
    before every restart, growing with the run."""

    CHUNK = 4 << 20

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0  # the file is read up to here: the end of its last complete line
        self._events: list[Event] = []

    def events(self) -> list[Event]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self._offset:  # not the file read before (replaced): from the start
                    self._offset, self._events = 0, []
                f.seek(self._offset)
                tail = b""
                while chunk := f.read(self.CHUNK):
                    lines = (tail + chunk).split(b"\n")
                    tail = lines.pop()  # after the last newline: a line still being written
                    self._offset += len(chunk)
                    self._decode(lines)
                self._offset -= len(tail)
        except OSError:
            pass
        return list(self._events)

    def _decode(self, lines: list[bytes]) -> None:
        for line in lines:
            if not any(k in line for k in WANTED):  # most lines are liveness and device samples: not parsed
                continue
            event = event_of(decode_line(line, supervisor=True))
            if event is not None:
                self._events.append(event)
