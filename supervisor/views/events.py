"""What happened during a run, as one list of events: top's footer and the report's timeline.

Sources: the status records and the supervisor's own records in metrics.jsonl
(checkpoint, nan, error, restart, recovery, gpu_event, eval) and the warning/error lines
of supervisor.log (throttling, memory nearly full, hangs, teardown). Several
ranks report the same checkpoint or NaN step; those collapse into one event.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.output import rank_set
from supervisor.views.run_files import LogLine


@dataclass(frozen=True)
class Event:
    time: float  # unix seconds
    kind: str  # checkpoint | nan (also spikes) | suspect | error | restart | recovery | xid | ecc | eval | warning
    text: str  # one short line
    rank: int | None = None


def save_cost(record: dict[str, Any]) -> str:
    """` (async: loop blocked 0.05 s, written in 2.31 s)` from a `checkpoint` record ("" from an
    older gpuherd's, which carried no costs)."""
    stall, write = record.get("stall_s"), record.get("write_s")
    if not isinstance(stall, (int, float)) or not isinstance(write, (int, float)):
        return ""
    wait = record.get("wait_s")
    waited = f", {wait:.2f} s of it waiting for the previous write" if isinstance(wait, (int, float)) and wait else ""
    if record.get("mode") == "async":
        return f" (async: loop blocked {stall:.2f} s{waited}, written in {write:.2f} s)"
    return f" (loop blocked {stall:.2f} s{waited})"


def event_of(record: dict[str, Any]) -> Event | None:
    """The event a metrics record stands for, or None for samples and heartbeats."""
    kind, when, rank = record.get("type"), _time(record), record.get("rank")
    if kind == "checkpoint":
        return Event(when, "checkpoint", f"checkpoint saved at step {record.get('step')}: "
                                         f"{Path(str(record.get('path', '?'))).name}{save_cost(record)}")
    if kind == "checkpoint_write" and record.get("state") == "failed":
        return Event(when, "error", f"rank {rank}: the background write of "
                                    f"{Path(str(record.get('path', '?'))).name} failed", rank)
    if kind in ("nan", "spike"):
        return _suspicious_step(record, when, rank)
    if kind == "suspect":
        return Event(when, "suspect", f"device {record.get('device')} ({record.get('host')}) suspect: "
                                      f"{record.get('transient_faults')} transient fault(s), limit {record.get('limit')}"
                                      + (": stopping the run" if record.get("stopping") else ""), rank)
    if kind == "error":
        return Event(when, "error", f"rank {rank}: {error_line(record)[:160]}", rank)
    if kind == "restart":
        excluded = record.get("excluded_gpus") or []
        without = (f"; without suspect GPU {', '.join(map(str, excluded))}, world size {record.get('world_size')}"
                   if excluded else "")
        return Event(when, "restart", f"restart {record.get('attempt')} after exit code {record.get('exit_code')}: "
                                      f"{record.get('after')}{without}")
    if kind == "recovery":
        if record.get("outcome") == "recovered" and record.get("action") == "shrink":
            return Event(when, "recovery", f"live recovery {record.get('number')}: rank {record.get('rank')} lost with "
                                           f"no spare left: {record.get('replicas')} process(es) went on with its data "
                                           f"slot in {_num(record.get('seconds'))} s: {record.get('failed')}",
                         record.get("rank"))
        if record.get("outcome") == "recovered":
            where = f"node {record.get('node')}'s " if record.get("node") is not None else ""
            return Event(when, "recovery", f"live recovery {record.get('number')}: {where}rank {record.get('rank')} replaced by "
                                           f"spare pid {record.get('replaced_by_pid')} in {_num(record.get('seconds'))} s, "
                                           f"{record.get('steps_redone')} step(s) redone: {record.get('failed')}",
                         record.get("rank"))
        return Event(when, "recovery", f"live recovery {record.get('number')} failed: {record.get('failed')}",
                     record.get("rank"))
    if kind == "gpu_event":
        name = "xid" if record.get("event") == "xid" else "ecc"
        what = f"XID {record.get('data')}" if name == "xid" else "double-bit ECC error"
        return Event(when, name, f"GPU {record.get('gpu')}: {what}", rank)
    if kind == "eval":
        return Event(when, "eval", f"validation loss {_num(record.get('val_loss'))} at step {record.get('step')}", rank)
    return None


def error_line(record: dict[str, Any]) -> str:
    """An `error` record's first line. The status channel keeps each record under 4 KB by
    dropping a longer one's fields (`truncated`), so a long error can arrive without its message."""
    lines = str(record.get("message") or "").strip().splitlines()
    if lines:
        return lines[0]
    if record.get("truncated"):
        return "error (its message was too long for the status channel: see the rank's log)"
    return "error (no message)"


_ACTIONS = {"skip": "skipped", "retried": "retried (the replay came out clean)", "stop": "stopped the run"}
_WHAT = {"nonfinite": "non-finite loss/gradient", "loss_spike": "loss spike", "grad_norm_spike": "grad-norm spike"}


def _suspicious_step(record: dict[str, Any], when: float, rank: Any) -> Event:
    """A `nan` or `spike` record: what was suspicious, and what the policy did about it."""
    what = _WHAT.get(str(record.get("kind")), "non-finite loss/gradient" if record.get("type") == "nan" else "spike")
    action = _ACTIONS.get(str(record.get("action")), "stopped the run")
    if record.get("classification"):
        action += f"; {record['classification']}"
    return Event(when, "nan", f"{what} at step {record.get('step')} (loss {record.get('loss')}): {action}", rank)


FOLD_S = 10.0  # the same event from several ranks within this long of the first: one event


@dataclass
class _Fold:
    """One event that several ranks reported alike: `ranks 0-2047: <what>`."""

    first: Event
    what: str
    ranks: list[int]

    def event(self) -> Event:
        if len(self.ranks) == 1:
            return self.first
        return Event(self.first.time, self.first.kind, f"ranks {rank_set.ranges(self.ranks)}: {self.what}",
                     self.first.rank)


class EventLog:
    """The events of a run's records and warning lines, added as they are read. What every
    rank reports alike is one event: once per step for checkpoints, NaN steps and
    evaluations; `rank N: <what>` from several ranks within FOLD_S s: `ranks 0-2047: <what>`."""

    def __init__(self) -> None:
        self._events: list[Event | _Fold] = []
        self._seen: set[tuple[str, Any]] = set()
        self._folds: dict[tuple[str, str], _Fold] = {}

    def add(self, record: dict[str, Any]) -> None:
        event = event_of(record)
        if event is None:
            return
        if event.kind in ("checkpoint", "nan", "eval"):
            key = (event.kind, record.get("step"))
            if key in self._seen:
                return
            self._seen.add(key)
        prefix = f"rank {event.rank}: "
        if isinstance(event.rank, int) and event.text.startswith(prefix):
            what = event.text[len(prefix):]
            fold = self._folds.get((event.kind, what))
            if fold is not None and 0 <= event.time - fold.first.time <= FOLD_S and event.rank not in fold.ranks:
                fold.ranks.append(event.rank)
                return
            self._folds[(event.kind, what)] = fold = _Fold(event, what, [event.rank])
            self._events.append(fold)
            return
        self._events.append(event)

    def add_warnings(self, warnings: list[LogLine]) -> None:
        for w in warnings:
            self._events.append(Event(_log_time(w.when), "warning" if w.level == "WARNING" else "error", w.message))

    def events(self) -> list[Event]:
        """Oldest first."""
        return sorted((e.event() if isinstance(e, _Fold) else e for e in self._events), key=lambda e: e.time)


def collect(records: list[dict[str, Any]], warnings: list[LogLine]) -> list[Event]:
    """Every event of a run, oldest first; one per (kind, step) for what all ranks report alike."""
    log = EventLog()
    for record in records:
        log.add(record)
    log.add_warnings(warnings)
    return log.events()


def _time(record: dict[str, Any]) -> float:
    value = record.get("time")
    return float(value) if isinstance(value, (int, float)) else 0.0


def _log_time(text: str) -> float:
    """supervisor.log stamps are local time, as loguru writes them."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return 0.0


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)
