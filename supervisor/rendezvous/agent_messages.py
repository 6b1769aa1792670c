"""The node agent's control plane, declared once: every command the supervisor sends it and
every event it answers with, as frozen dataclasses, and the one place a line of either is
decoded (`decode_command` in `Agent.handle`, `decode_event` in the job link's reader).

One JSON object per line: a command carries its name in "cmd", an event in "event"; the other
keys are the class's fields. A field the class does not declare is ignored (a newer peer's
message still decodes); a missing required field, a field of the wrong type, or a name nobody
declared is refused whole with `Malformed`, whose text names what was dropped. Everything past
these two functions reads attributes, never keys (tests/test_records_decoded_once.py).

The root causes (`cause`, `silent`), join records (`record`, `nodes`), outcomes and live-recovery
claims they carry stay plain JSON objects here: each has its own reader (agent_causes.py,
fixed_join.is_record, live_recovery.py).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import orjson

Json = dict[str, Any]


class Malformed(ValueError):
    """A line that is no message of this protocol; its text says what was dropped and why."""


@dataclass(frozen=True, kw_only=True)
class Command:
    CMD: ClassVar[str] = ""
    attempt: int = -1  # the attempt (round) it is about; -1: none


@dataclass(frozen=True, kw_only=True)
class Join(Command):
    CMD: ClassVar[str] = "join"
    record: Json  # this node's join record (host, nproc, settings)


@dataclass(frozen=True, kw_only=True)
class Watch(Command):
    CMD: ClassVar[str] = "watch"


@dataclass(frozen=True, kw_only=True)
class PublishAbort(Command):
    CMD: ClassVar[str] = "abort"
    cause: Json  # this node's failure, offered as the job's root cause


@dataclass(frozen=True, kw_only=True)
class Done(Command):
    CMD: ClassVar[str] = "done"


@dataclass(frozen=True, kw_only=True)
class WaitDone(Command):
    CMD: ClassVar[str] = "wait-done"
    timeout: float


@dataclass(frozen=True, kw_only=True)
class CheckAlive(Command):
    CMD: ClassVar[str] = "alive"


@dataclass(frozen=True, kw_only=True)
class ShareOutcome(Command):
    CMD: ClassVar[str] = "outcome"
    outcome: Json


@dataclass(frozen=True, kw_only=True)
class GatherOutcomes(Command):
    CMD: ClassVar[str] = "outcomes"
    timeout: float


@dataclass(frozen=True, kw_only=True)
class Leave(Command):
    CMD: ClassVar[str] = "leave"


@dataclass(frozen=True, kw_only=True)
class ShareLines(Command):
    CMD: ClassVar[str] = "lines"
    records: list[Any]  # console lines held for folding across nodes (cross_node.py)


@dataclass(frozen=True, kw_only=True)
class Linger(Command):
    CMD: ClassVar[str] = "linger"
    timeout: float


@dataclass(frozen=True, kw_only=True)
class ClaimRegroup(Command):
    CMD: ClassVar[str] = "regroup-claim"
    generation: int
    claim: Json  # the live-recovery claim (regroup_agent.py)


@dataclass(frozen=True, kw_only=True)
class WatchRegroups(Command):
    CMD: ClassVar[str] = "regroup-watch"


@dataclass(frozen=True, kw_only=True)
class StandBy(Command):
    CMD: ClassVar[str] = "stand-by"
    record: Json  # this spare node's join record


@dataclass(frozen=True, kw_only=True)
class MoveNodeOut(Command):
    CMD: ClassVar[str] = "move-out"
    node: int  # node 0: a node slower than the others for the set time (node_stragglers.py)
    message: str  # the verdict, with its evidence (one line)


@dataclass(frozen=True, kw_only=True)
class Event:
    EVENT: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True)
class Waiting(Event):
    EVENT: ClassVar[str] = "waiting"
    attempt: int
    round: int
    members: list[int]  # the nodes running that round without this one


@dataclass(frozen=True, kw_only=True)
class Joined(Event):
    EVENT: ClassVar[str] = "joined"
    attempt: int
    round: int
    members: list[int]
    nodes: list[Json]  # every member's join record, in node-rank order


@dataclass(frozen=True, kw_only=True)
class JoinTimedOut(Event):
    EVENT: ClassVar[str] = "join-timeout"
    attempt: int
    missing: list[int]
    timeout: float
    unreachable: bool = False  # the store itself did not answer
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class JoinClosed(Event):
    EVENT: ClassVar[str] = "join-closed"
    attempt: int


@dataclass(frozen=True, kw_only=True)
class JoinAborted(Event):
    EVENT: ClassVar[str] = "join-aborted"
    attempt: int


@dataclass(frozen=True, kw_only=True)
class Aborted(Event):
    EVENT: ClassVar[str] = "abort"
    attempt: int
    cause: Json  # the job's root cause: the first one any node published


@dataclass(frozen=True, kw_only=True)
class Finished(Event):
    EVENT: ClassVar[str] = "finished"
    attempt: int
    missing: list[int]  # members whose workers did not finish in time


@dataclass(frozen=True, kw_only=True)
class AliveChecked(Event):
    EVENT: ClassVar[str] = "alive"
    attempt: int
    silent: list[Json]  # the nodes found dead, each as a root cause


@dataclass(frozen=True, kw_only=True)
class Outcomes(Event):
    EVENT: ClassVar[str] = "outcomes"
    ranks: list[int]
    nodes: list[Json | None]  # each rank's outcome; None: it did not say


@dataclass(frozen=True, kw_only=True)
class Lines(Event):
    EVENT: ClassVar[str] = "lines"
    node: int
    records: list[Any]


@dataclass(frozen=True, kw_only=True)
class Lingered(Event):
    EVENT: ClassVar[str] = "lingered"
    missing: list[int]


@dataclass(frozen=True, kw_only=True)
class RegroupClaimed(Event):
    EVENT: ClassVar[str] = "regroup-claim"
    attempt: int
    generation: int
    won: bool
    claim: Json | None = None  # the winner's claim; None: a value no node writes


@dataclass(frozen=True, kw_only=True)
class Regrouped(Event):
    EVENT: ClassVar[str] = "regroup"
    attempt: int
    generation: int
    claim: Json | None = None


@dataclass(frozen=True, kw_only=True)
class StandingBy(Event):
    EVENT: ClassVar[str] = "standing-by"
    attempt: int
    nodes: list[Json]


@dataclass(frozen=True, kw_only=True)
class Promoted(Event):
    EVENT: ClassVar[str] = "promoted"
    attempt: int
    generation: int
    node: int  # the dead node whose place this spare node takes
    claim: Json
    nodes: list[Json]


@dataclass(frozen=True, kw_only=True)
class SpareClosed(Event):
    EVENT: ClassVar[str] = "spare-closed"
    attempt: int


@dataclass(frozen=True, kw_only=True)
class SpareRefused(Event):
    EVENT: ClassVar[str] = "spare-refused"
    attempt: int
    message: str
    exit_code: int = 2


@dataclass(frozen=True, kw_only=True)
class SparePassedOver(Event):
    EVENT: ClassVar[str] = "spare-passed-over"
    attempt: int
    message: str


@dataclass(frozen=True, kw_only=True)
class NodeMoveAnswer(Event):
    EVENT: ClassVar[str] = "move-out"
    attempt: int
    node: int
    why_not: str | None = None  # None: the node was told to leave (a spare node takes its place)


@dataclass(frozen=True, kw_only=True)
class MovedOut(Event):
    EVENT: ClassVar[str] = "moved-out"
    attempt: int
    message: str  # node 0's words: why this node was moved out of the job


@dataclass(frozen=True, kw_only=True)
class Lost(Event):
    EVENT: ClassVar[str] = "lost"
    message: str  # the job store is gone


COMMANDS: dict[str, type[Command]] = {c.CMD: c for c in Command.__subclasses__()}
EVENTS: dict[str, type[Event]] = {e.EVENT: e for e in Event.__subclasses__()}


def encode(message: Command | Event) -> bytes:
    """One line of the protocol (newline included)."""
    name = {"cmd": message.CMD} if isinstance(message, Command) else {"event": message.EVENT}
    return orjson.dumps({**name, **{f.name: getattr(message, f.name) for f in dataclasses.fields(message)}}) + b"\n"


def command(name: str, **fields: Any) -> Command:
    """The command `name` built from its fields (TypeError: a field it does not declare)."""
    return COMMANDS[name](**fields)


def event(name: str, **fields: Any) -> Event:
    return EVENTS[name](**fields)


def decode_command(raw: bytes | Json) -> Command:
    return _decode(raw, "cmd", COMMANDS, "command")


def decode_event(raw: bytes | Json) -> Event:
    return _decode(raw, "event", EVENTS, "event")


def _decode(raw: bytes | Json, key: str, classes: dict[str, type], what: str) -> Any:
    shown = _shown(raw)
    try:
        obj = orjson.loads(raw) if isinstance(raw, bytes | bytearray | str) else raw
    except orjson.JSONDecodeError:
        raise Malformed(f"dropped a line that is not JSON: {shown}") from None
    if not isinstance(obj, dict):
        raise Malformed(f"dropped a line that is not a JSON object: {shown}")
    cls = classes.get(obj.get(key)) if isinstance(obj.get(key), str) else None
    if cls is None:
        raise Malformed(f"dropped an unknown {what}: {shown}")
    values = {}
    for name, hint in _hints(cls).items():
        if name not in obj:
            continue
        if not _fits(obj[name], hint):
            raise Malformed(f"dropped a {obj[key]!r} {what} whose {name!r} is not {_said(hint)}: {shown}")
        values[name] = float(obj[name]) if hint is float else obj[name]
    try:
        return cls(**values)
    except TypeError:
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in values]
        raise Malformed(f"dropped a {obj[key]!r} {what} without {', '.join(map(repr, missing))}: {shown}") from None


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return _HINTS[cls]


def _fits(value: Any, hint: Any) -> bool:
    """`value` (parsed JSON) is of type `hint`: the outer type, and a list's items where declared."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_fits(v, item) for v in value)
    return isinstance(value, origin or hint)


def _said(hint: Any) -> str:
    """`float`, `list[int]`, `dict[str, Any] | None`: a type as its declaration reads."""
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _shown(raw: bytes | Json) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes | bytearray) else repr(raw)
    return text.strip()[:200]
