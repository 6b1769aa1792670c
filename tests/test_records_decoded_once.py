"""A status record is decoded once, in gpuherd/status_records.py, a node agent's command or
event once, in supervisor/rendezvous/agent_messages.py, and a live recovery's claim once, in
supervisor/rendezvous/live_claim.py; each is read as a typed value after.

No code outside those modules reads a decoded record, message or claim as a dict (`.get(...)`,
`record["field"]`): the checker below finds, in every module of the product, the names that hold
one (a parameter or name annotated with a record, message or claim type; a name bound to
`decode(...)`, `from_object(...)`, `readable(...)`, `decode_command(...)`, `decode_event(...)` or
`decode_claim(...)`, or to a call of a product function declared to return one; a loop over what a
metrics reader yields) and fails on a dict read of any of them. Nor may any module read the `"type"`, `"cmd"`
or `"event"` of a dict it parsed from JSON itself (`orjson.loads`, `json.loads`): that is a
record or message decoded outside its decoder. Other dicts (summary.json, a join record, a
sample the supervisor built itself) are not flagged. At run time a record or message has no
`get` and no `[]` at all, so the two checks together leave no dict reading of one that passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuherd import status_records
from gpuherd.status_records import Record
from supervisor.rendezvous import agent_messages
from supervisor.rendezvous.agent_messages import Command, Event
from supervisor.rendezvous.live_claim import LiveClaim

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpuherd", "supervisor", "worker", "dataset_cache")
DECODERS = tuple(REPO / path for path in ("gpuherd/status_records.py", "supervisor/rendezvous/agent_messages.py",
                                           "supervisor/rendezvous/live_claim.py"))
DECODING_MODULES = ("gpuherd.status_records", "gpuherd.status_channel", "supervisor.views.run_files")
DECODING_CALLS = {"decode", "from_object", "readable", "decode_line", "decode_command", "decode_event", "decode_claim"}
READER_METHODS = {"poll_each", "poll", "each_new", "read_new"}  # RunFiles / JsonlTail: records as they come
TYPE_KEYS = {"type", "cmd", "event"}  # what names a record's or a message's kind on the wire
MESSAGES_MODULE = "supervisor.rendezvous.agent_messages"
RECORD_TYPES = frozenset(name for name, value in vars(status_records).items()
                         if isinstance(value, type) and issubclass(value, Record)) | {"LiveClaim"}
# Names as plain as `Event` or `Lines` mean a message only in a module that imports them from
# agent_messages.py (goodput has an `Event` of its own)
MESSAGE_TYPES = frozenset(name for name, value in vars(agent_messages).items()
                          if isinstance(value, type) and issubclass(value, Command | Event))


def _handles_records(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module in DECODING_MODULES for node in ast.walk(tree))


def _types_in(tree: ast.Module) -> frozenset[str]:
    """The type names that mean a decoded record or message in this module."""
    messages = any(isinstance(n, ast.ImportFrom) and (n.module == MESSAGES_MODULE or any(
        f"{n.module}.{a.name}" == MESSAGES_MODULE for a in n.names)) for n in ast.walk(tree))
    return RECORD_TYPES | MESSAGE_TYPES if messages else RECORD_TYPES


def _annotated_as_record(annotation: ast.expr | None, types: frozenset[str]) -> bool:
    return annotation is not None and any(
        isinstance(n, ast.Name) and n.id in types for n in ast.walk(annotation)) or (
        isinstance(annotation, ast.Constant) and isinstance(annotation.value, str)
        and any(t in annotation.value.replace("|", " ").replace("[", " ").replace("]", " ").split()
                for t in types))


def _call_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    return None


def _names_loads(node: ast.AST) -> bool:
    """`orjson.loads` / `loads` named (a call or a function passed on, as to `map`)."""
    return (isinstance(node, ast.Attribute) and node.attr == "loads") or (isinstance(node, ast.Name)
                                                                         and node.id == "loads")


def _parsed_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names in `function` bound to JSON it parsed itself."""
    names = set()
    for node in ast.walk(function):
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) else None
        calls = [c for c in ast.walk(value) if _call_name(c) == "loads"] if value is not None else []
        if calls:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.For | ast.comprehension) and isinstance(node.target, ast.Name) and \
                any(_names_loads(c) for c in ast.walk(node.iter)):
            names.add(node.target.id)
    return names


def returning_records(tree: ast.Module) -> set[str]:
    """The names of the functions in `tree` declared to return a record or a message."""
    types = _types_in(tree)
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            and _annotated_as_record(n.returns, types)}


def _record_names(function: ast.FunctionDef | ast.AsyncFunctionDef, handles: bool, calls: set[str],
                  types: frozenset[str]) -> set[str]:
    """The names in `function` that hold a decoded record (`calls`: those that return one; `types`:
    the record and message types of its module)."""
    args = function.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]
             if _annotated_as_record(a.annotation, types)}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AnnAssign) and _call_name(node.value) in calls:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.NamedExpr) and _call_name(node.value) in calls:
            names.add(node.target.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                _annotated_as_record(node.annotation, types):
            names.add(node.target.id)
        elif isinstance(node, ast.For | ast.comprehension) and handles and \
                _call_name(node.iter) in READER_METHODS and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _other_protocols(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[int]:
    """The reads in `function` compared only with kinds no agent message has (torch's file timer
    log has an "event" key too: `event.get("event") == "kill worker process"` is its, not ours)."""
    ours = set(agent_messages.COMMANDS) | set(agent_messages.EVENTS)
    return {id(n.left) for n in ast.walk(function) if isinstance(n, ast.Compare) and all(
        isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value not in ours for c in n.comparators)}


def dict_reads(source: str, where: str = "<source>", returning: frozenset[str] = frozenset()) -> list[str]:
    """Every dict-style read of a decoded record or message in `source`, as `where:line: text`
    (`returning`: the product's functions that return one, besides those `source` declares)."""
    tree = ast.parse(source)
    handles = _handles_records(tree)
    calls, types = DECODING_CALLS | returning | returning_records(tree), _types_in(tree)
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        names, parsed = _record_names(function, handles, calls, types), _parsed_names(function)
        foreign = _other_protocols(function)
        for node in ast.walk(function):
            receiver = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                receiver, key = node.func.value, node.args[0] if node.args else None
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                receiver, key = node.value, node.slice
            if receiver is None:
                continue
            on_record = isinstance(receiver, ast.Name) and receiver.id in names
            type_key = isinstance(receiver, ast.Name) and receiver.id in parsed and \
                isinstance(key, ast.Constant) and key.value in TYPE_KEYS and \
                (key.value == "type" or id(node) not in foreign)
            if on_record or type_key:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def _product_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")) if p not in DECODERS]


def test_no_decoded_record_or_message_is_read_as_a_dict_outside_its_decoder():
    files = {path: path.read_text() for path in _product_files()}
    returning = frozenset().union(*(returning_records(ast.parse(text)) for text in files.values()))
    found = [hit for path, text in files.items() for hit in dict_reads(text, str(path.relative_to(REPO)), returning)]
    assert not found, ("decoded status records or node agent messages read as dicts (read their attributes, "
                       "match on their types):\n" + "\n".join(found))


@pytest.mark.parametrize("source", [
    "def f(record: Step):\n    return record.get('step')",
    "def f(record: Record | None):\n    return record['step']",
    "def f(rec: 'Alive'):\n    return rec.get('phase')",
    "def f(line):\n    r = decode(line)\n    return r.get('step')",
    "def f(obj):\n    if (r := from_object(obj)) is not None:\n        return r['rank']",
    "from supervisor.views.run_files import RunFiles\ndef f(files):\n    for r in files.poll_each():\n"
    "        print(r.get('loss'))",
    "def f(line):\n    d = orjson.loads(line)\n    return d.get('type') == 'step'",
    "def f(lines):\n    return [r for r in map(orjson.loads, lines) if r['type'] == 'step']",
    # the node agent's commands and events
    "from supervisor.rendezvous.agent_messages import Join\ndef f(self, cmd: Join):\n    return cmd.get('record')",
    "from supervisor.rendezvous import agent_messages\ndef f(event: 'Aborted | None'):\n    return event['cause']",
    "def f(line):\n    e = decode_event(line)\n    return e.get('attempt')",
    "def f(raw):\n    if (c := decode_command(raw)) is not None:\n        return c['cmd']",
    "def f(line):\n    msg = orjson.loads(line)\n    return msg.get('cmd')",
    "def f(line):\n    event = orjson.loads(line)\n    return event['event'] == 'joined'",
    "from supervisor.rendezvous.agent_messages import Event\ndef _reply(self, timeout) -> Event:\n    ...\n"
    "def f(self):\n    e = self._reply(3)\n    return e['missing']",
    # a live recovery's claim
    "def f(claim: LiveClaim | None):\n    return claim.get('spare_node')",
    "def f(raw):\n    heard = decode_claim(raw)\n    return heard['rank']",
])
def test_the_checker_finds_each_way_a_record_is_read_as_a_dict(source):
    assert dict_reads(source)


@pytest.mark.parametrize("source", [
    "def f(summary: dict):\n    return summary.get('exit_code')",
    "def f(record: Step):\n    return record.step",
    "def f(sample: dict):\n    return sample.get('type')",  # a sample the supervisor built itself
    "def f(line):\n    d = orjson.loads(line)\n    return d.get('nodes')",  # another protocol's message
    "from gpuherd.status_records import decode\ndef f(cfg):\n    return cfg.get('system', {})",
    "def f(groups: list[Event]):\n    return groups[-1]",  # another room's `Event` (goodput's)
    # torch's file timer log: an "event" key of another protocol
    "def f(line):\n    event = json.loads(line)\n    return event.get('event') == 'kill worker process'",
    # a join record a message carries is a dict of its own (fixed_join.is_record reads it)
    "from supervisor.rendezvous.agent_messages import Join\ndef f(cmd: Join):\n    return cmd.record.get('host')",
])
def test_the_checker_leaves_other_dicts_alone(source):
    assert dict_reads(source) == []


def test_a_product_function_that_returns_a_message_marks_what_it_returns_elsewhere_too():
    source = "def f(link):\n    promotion = link.stand_by(0, {})\n    return promotion['nodes']"
    assert dict_reads(source) == []
    assert dict_reads(source, returning=frozenset({"stand_by"}))


def test_a_record_or_message_has_no_dict_interface_at_all():
    for name in RECORD_TYPES | MESSAGE_TYPES:
        cls = getattr(status_records, name, None) or getattr(agent_messages, name, None) or LiveClaim
        assert not hasattr(cls, "get") and not hasattr(cls, "__getitem__"), name
