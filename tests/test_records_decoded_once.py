"""A status record is decoded once, in gpuherd/status_records.py, and read as a typed value after.

No code outside that module reads a decoded record as a dict (`.get(...)`, `record["field"]`):
the checker below finds, in every module of the product, the names that hold a decoded record
(a parameter annotated with a record type; a name bound to `decode(...)`, `from_object(...)` or
`readable(...)` of the decoding modules; a loop over what a metrics reader yields) and fails on
a dict read of any of them. Nor may any module read the `"type"` of a dict it parsed from JSON
itself (`orjson.loads`, `json.loads`): that is a record decoded outside the decoder. Other dicts
(summary.json, the node agent's messages, a sample the supervisor built itself) are not flagged.
At run time a record has no `get` and no `[]` at all, so the two checks together leave no dict
reading of a record that passes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuherd import status_records
from gpuherd.status_records import Record

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("gpuherd", "supervisor", "worker", "dataset_cache")
DECODER = REPO / "gpuherd" / "status_records.py"
DECODING_MODULES = ("gpuherd.status_records", "gpuherd.status_channel", "supervisor.views.run_files")
DECODING_CALLS = {"decode", "from_object", "readable", "decode_line"}
READER_METHODS = {"poll_each", "poll", "each_new", "read_new"}  # RunFiles / JsonlTail: records as they come
RECORD_TYPES = {name for name, value in vars(status_records).items()
                if isinstance(value, type) and issubclass(value, Record)}


def _handles_records(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.ImportFrom) and node.module in DECODING_MODULES for node in ast.walk(tree))


def _annotated_as_record(annotation: ast.expr | None) -> bool:
    return annotation is not None and any(
        isinstance(n, ast.Name) and n.id in RECORD_TYPES for n in ast.walk(annotation)) or (
        isinstance(annotation, ast.Constant) and isinstance(annotation.value, str)
        and any(t in annotation.value.replace("|", " ").replace("[", " ").replace("]", " ").split()
                for t in RECORD_TYPES))


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


def _record_names(function: ast.FunctionDef | ast.AsyncFunctionDef, handles: bool) -> set[str]:
    """The names in `function` that hold a decoded record."""
    args = function.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs] if _annotated_as_record(a.annotation)}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AnnAssign) and _call_name(node.value) in DECODING_CALLS:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.NamedExpr) and _call_name(node.value) in DECODING_CALLS:
            names.add(node.target.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                _annotated_as_record(node.annotation):
            names.add(node.target.id)
        elif isinstance(node, ast.For | ast.comprehension) and handles and \
                _call_name(node.iter) in READER_METHODS and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def dict_reads(source: str, where: str = "<source>") -> list[str]:
    """Every dict-style read of a decoded record in `source`, as `where:line: text`."""
    tree = ast.parse(source)
    handles = _handles_records(tree)
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        names, parsed = _record_names(function, handles), _parsed_names(function)
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
                isinstance(key, ast.Constant) and key.value == "type"
            if on_record or type_key:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def _product_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py")) if p != DECODER]


def test_no_decoded_record_is_read_as_a_dict_outside_the_decoder():
    found = [hit for path in _product_files() for hit in dict_reads(path.read_text(), str(path.relative_to(REPO)))]
    assert not found, "decoded status records read as dicts (match on the record types instead):\n" + "\n".join(found)


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
])
def test_the_checker_finds_each_way_a_record_is_read_as_a_dict(source):
    assert dict_reads(source)


@pytest.mark.parametrize("source", [
    "def f(summary: dict):\n    return summary.get('exit_code')",
    "def f(record: Step):\n    return record.step",
    "def f(sample: dict):\n    return sample.get('type')",  # a sample the supervisor built itself
    "def f(line):\n    d = orjson.loads(line)\n    return d.get('nodes')",  # another protocol's message
    "from gpuherd.status_records import decode\ndef f(cfg):\n    return cfg.get('system', {})",
])
def test_the_checker_leaves_other_dicts_alone(source):
    assert dict_reads(source) == []


def test_a_record_has_no_dict_interface_at_all():
    for name in RECORD_TYPES:
        cls = getattr(status_records, name)
        assert not hasattr(cls, "get") and not hasattr(cls, "__getitem__"), name
