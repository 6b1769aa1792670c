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

from gpuherd.status_records import (NODE_MOVED_OUT, Checkpoint, CheckpointWrite, Error, Eval, GpuEvent, Nan, Record,
                                    Recovery, Restart, ScriptSave, Sdc, Suspect, SuspiciousStep)
from supervisor.output import rank_set
from supervisor.views.run_files import LogLine


@dataclass(frozen=True)
class Event:
    time: float  # unix seconds
    # checkpoint | nan (also spikes) | suspect | sdc | error | restart | recovery | xid | ecc | eval | warning
    kind: str
    text: str  # one short line
    rank: int | None = None


def save_cost(record: Checkpoint) -> str:
    """` (async: loop blocked 0.05 s, written in 2.31 s)` from a `checkpoint` record ("" from an
    older gpuherd's, which carried no costs)."""
    stall, write, wait = record.stall_s, record.write_s, record.wait_s
    if stall is None or write is None:
        return ""
    waited = f", {wait:.2f} s of it waiting for the previous write" if wait else ""
    if record.mode == "async":
        return f" (async: loop blocked {stall:.2f} s{waited}, written in {write:.2f} s)"
    return f" (loop blocked {stall:.2f} s{waited})"


def event_of(record: Record) -> Event | None:
    """The event a metrics record stands for, or None for samples and heartbeats."""
    when, rank = record.time or 0.0, record.rank
    match record:
        case Checkpoint():
            return Event(when, "checkpoint", f"checkpoint saved at step {record.step}: "
                                             f"{Path(record.path or '?').name}{save_cost(record)}")
        case ScriptSave():  # a --script's own save, as gpuherd saw it (each rank of a sharded save: one line)
            return Event(when, "checkpoint", f"rank {rank}: the script saved {record.path or 'into a buffer (no path)'} "
                                             f"with {record.api} at step {record.step}", rank)
        case CheckpointWrite(state="failed"):
            return Event(when, "error", f"rank {rank}: the background write of "
                                        f"{Path(record.path or '?').name} failed", rank)
        case SuspiciousStep():
            return _suspicious_step(record, when, rank)
        case Suspect():
            return Event(when, "suspect", f"device {record.device} ({record.host}) suspect: "
                                          f"{record.transient_faults} {record.cause or 'transient fault'}(s), "
                                          f"limit {record.limit}" + (": stopping the run" if record.stopping else ""),
                         rank)
        case Sdc():
            evidence = record.evidence or ("-",)
            culprits = ", ".join(map(str, record.culprits))
            how = f"named by {record.blamed_by}, healed by {record.healed}"
            return Event(when, "sdc", f"silent data corruption after step {record.step}: rank(s) {culprits} "
                                      f"{how}: {evidence[0]}", rank)
        case Error():
            return Event(when, "error", f"rank {rank}: {error_line(record)[:160]}", rank)
        case Restart():
            excluded = record.excluded_gpus
            without = (f"; without suspect GPU {', '.join(map(str, excluded))}, world size {record.world_size}"
                       if excluded else "")
            saw = f"; {record.script_save}" if record.script_save else ""
            return Event(when, "restart", f"restart {record.attempt} after exit code {record.exit_code}: "
                                          f"{record.after}{without}{saw}")
        case Recovery():
            return _recovery(record, when, rank)
        case GpuEvent():
            name = "xid" if record.event == "xid" else "ecc"
            what = f"XID {record.data}" if name == "xid" else "double-bit ECC error"
            return Event(when, name, f"GPU {record.gpu}: {what}", rank)
        case Eval():
            return Event(when, "eval", f"validation loss {_num(record.val_loss)} at step {record.step}", rank)
    return None


def _recovery(record: Recovery, when: float, rank: int | None) -> Event:
    """A live recovery's event: a spare's replacement, a shrink (a rank, or a node lost whole), a regrow."""
    match record:
        case Recovery(outcome="recovered", action="regrow"):
            return Event(when, "recovery", f"live recovery {record.number}: regrow: {_node(record)}warm spare pid "
                                           f"{record.replaced_by_pid} took back rank {rank} after "
                                           f"{_num(record.shrunk_s)} s shrunk: {record.replicas} process(es) again, "
                                           f"its first step in {_num(record.seconds)} s", rank)
        case Recovery(outcome="recovered", action="shrink", kind="node"):
            return Event(when, "recovery", f"live recovery {record.number}: node {record.node} died whole with no "
                                           f"spare node left: {record.replicas} process(es) went on with its ranks' "
                                           f"data slots in {_num(record.seconds)} s", rank)
        case Recovery(outcome="recovered", action="shrink"):
            return Event(when, "recovery", f"live recovery {record.number}: {_node(record)}rank {rank} lost with no "
                                           "spare left: "
                                           f"{record.replicas} process(es) went on with its data slot in "
                                           f"{_num(record.seconds)} s: {record.failed}", rank)
        case Recovery(outcome="recovered", action="spare-node"):
            gone = "was moved out as a straggler" if record.kind == NODE_MOVED_OUT else "died whole"
            return Event(when, "recovery", f"live recovery {record.number}: node {record.node} {gone}; spare node "
                                           f"{record.spare_node} took its ranks in {_num(record.seconds)} s, "
                                           f"{record.steps_redone} step(s) redone", rank)
        case Recovery(outcome="recovered"):
            return Event(when, "recovery", f"live recovery {record.number}: {_node(record)}rank {rank} replaced by "
                                           f"spare pid {record.replaced_by_pid} in {_num(record.seconds)} s, "
                                           f"{record.steps_redone} step(s) redone: {record.failed}", rank)
        case _:
            return Event(when, "recovery", f"live recovery {record.number} failed: {record.failed}", rank)


def _node(record: Recovery) -> str:
    """Multi-node: whose rank it was (every node records every node's recoveries)."""
    return f"node {record.node}'s " if record.node is not None else ""


def error_line(record: Error) -> str:
    """An `error` record's first line. The status channel keeps each record under 4 KB by
    dropping a longer one's fields (`truncated`), so a long error can arrive without its message."""
    lines = (record.message or "").strip().splitlines()
    if lines:
        return lines[0]
    if record.truncated:
        return "error (its message was too long for the status channel: see the rank's log)"
    return "error (no message)"


_ACTIONS = {"skip": "skipped", "retried": "retried (the replay came out clean)", "stop": "stopped the run"}
_WHAT = {"nonfinite": "non-finite loss/gradient", "loss_spike": "loss spike", "grad_norm_spike": "grad-norm spike"}


def _suspicious_step(record: SuspiciousStep, when: float, rank: int | None) -> Event:
    """A `nan` or `spike` record: what was suspicious, and what the policy did about it."""
    what = _WHAT.get(str(record.kind), "non-finite loss/gradient" if isinstance(record, Nan) else "spike")
    action = _ACTIONS.get(str(record.action), "stopped the run")
    if record.classification:
        action += f"; {record.classification}"
    return Event(when, "nan", f"{what} at step {record.step} (loss {record.loss}): {action}", rank)


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

    def add(self, record: Record) -> None:
        event = event_of(record)
        if event is None:
            return
        if event.kind in ("checkpoint", "nan", "eval") and not isinstance(record, ScriptSave):  # per rank: folded
            key = (event.kind, record.step if isinstance(record, (Checkpoint, SuspiciousStep, Eval)) else None)
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


def collect(records: list[Record], warnings: list[LogLine]) -> list[Event]:
    """Every event of a run, oldest first; one per (kind, step) for what all ranks report alike."""
    log = EventLog()
    for record in records:
        log.add(record)
    log.add_warnings(warnings)
    return log.events()


def _log_time(text: str) -> float:
    """supervisor.log stamps are local time, as loguru writes them."""
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return 0.0


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)
