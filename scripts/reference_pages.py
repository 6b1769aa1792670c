#!/usr/bin/env python3
"""The docs' reference tables, generated from the code that is their source.

Each generated table sits in its page between two markers,

    <!-- BEGIN GENERATED: NAME (scripts/reference_pages.py) -->
    <!-- END GENERATED: NAME -->

and everything outside them is written by hand. `python scripts/reference_pages.py` rewrites
the tables; `--check` only says which are stale (exit 1). tests/test_docs.py runs the check,
and the mkdocs hook (scripts/mkdocs_hooks.py) fails `mkdocs build` on a stale page, so a
renamed config key, a new exit code or a new status record cannot leave the docs behind.

Sources: gpuherd/exit_codes.py (ExitCode and its words), gpuherd/config/schema.py (every
section's fields, defaults, limits and the comment beside each), gpuherd/contract.py (the
environment a worker gets: torchrun's variables and gpuherd's own), gpuherd/status_records.py
(every record type, its fields and the comment beside each), and the parsers of `gpuherd` and
`gpuherd run`.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import re
import sys
import tokenize
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BEGIN = "<!-- BEGIN GENERATED: {name} (scripts/reference_pages.py) -->"
END = "<!-- END GENERATED: {name} -->"


def source_comments(path: Path, owner: str | None = None) -> dict[str, str]:
    """The comment of each assignment in `path`'s module body (owner None) or class `owner`:
    the full-line comments right above it, then the one at its line's end."""
    text = path.read_text()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = text.splitlines()
    tree = ast.parse(text)
    body = tree.body if owner is None else next(
        node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner)
    found: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].lstrip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = comments.get(node.end_lineno) if node.end_lineno in comments and \
            not lines[node.end_lineno - 1].lstrip().startswith("#") else None
        found[name] = " ".join([*above, *([trailing] if trailing else [])])
    return found


def cell(text: object) -> str:
    """Markdown table cell: pipes escaped, one line."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def exit_codes() -> str:
    from gpuherd.exit_codes import ExitCode, describe

    notes = source_comments(ROOT / "gpuherd" / "exit_codes.py", "ExitCode")
    rows = ["| code | name | words in summaries | meaning (gpuherd/exit_codes.py) |", "|---|---|---|---|"]
    aliases = {int(v): [n for n, m in ExitCode.__members__.items() if m == v and n != v.name] for v in ExitCode}
    for code in ExitCode:
        names = " = ".join(f"`{n}`" for n in (code.name, *aliases[int(code)]))
        meaning = "; ".join(notes[n] for n in (code.name, *aliases[int(code)]) if notes.get(n))
        rows.append(f"| {int(code)} | {names} | {cell(describe(int(code)))} | {cell(meaning)} |")
    return "\n".join(rows)


def _limits_text(field: dataclasses.Field) -> str:
    from gpuherd.config.limits import LIMITS

    limits = field.metadata.get(LIMITS)
    if limits is None:
        return ""
    parts = []
    if limits.choices:
        parts.append("one of " + ", ".join(f"`{c}`" for c in limits.choices))
    for op, word in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        bound = getattr(limits, op)
        if bound is not None:
            parts.append(f"{word} {bound:g}" if isinstance(bound, float) else f"{word} {bound}")
    if limits.ids:
        parts.append("distinct ids >= 0")
    return ", ".join(parts)


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return ""
    return f"`{json.dumps(value)}`"  # as a --config file or --set writes it


def config_keys() -> str:
    from gpuherd.config.schema import Config

    out = []
    for section in dataclasses.fields(Config):
        cls = section.default_factory  # type: ignore[misc]
        if not dataclasses.is_dataclass(cls):
            continue  # not a section (the preset's name)
        notes = source_comments(ROOT / "gpuherd" / "config" / "schema.py", cls.__name__)
        out += [f"### `{section.name}`", "", "| key | type | default (a preset may change it) | limits | meaning |",
                "|---|---|---|---|---|"]
        for field in dataclasses.fields(cls):
            out.append(f"| `{section.name}.{field.name}` | `{cell(field.type)}` | {cell(_default_text(field))} "
                       f"| {cell(_limits_text(field))} | {cell(notes.get(field.name, ''))} |")
        out.append("")
    return "\n".join(out).rstrip()


def environment() -> str:
    from gpuherd import contract

    notes = source_comments(ROOT / "gpuherd" / "contract.py")
    by_value = {getattr(contract, name): name for name in dir(contract) if name.isupper()
                and isinstance(getattr(contract, name), str)}
    rows = ["| variable | meaning (gpuherd/contract.py) |", "|---|---|"]
    for variable in contract.GPUHERD_VARS:
        rows.append(f"| `{variable}` | {cell(notes.get(by_value[variable], ''))} |")
    return "\n".join(rows)


# How each declared annotation of gpuherd/status_records.py reads as JSON (a new shape fails here,
# KeyError, until it is given its words).
_JSON_TYPES = {
    "int | None": "int or null", "float | None": "number or null", "str | None": "string or null",
    "bool": "bool", "str": "string", "float": "number", "float | str | None": "number, string or null",
    "tuple[int, ...]": "list of int", "tuple[float, ...]": "list of numbers", "tuple[str, ...]": "list of strings", "tuple[str, ...] | str | None": "list of strings, string or null",
    "dict[str, tuple[int, float]]": "{phase: [count, seconds]}", "dict[str, float] | None": "{node: ms} or null",
}


def _record_default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    else:
        value = field.default_factory()  # type: ignore[misc]
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _record_name(cls: type) -> str:
    event = getattr(cls, "EVENT", "")
    return f"`{cls.TYPE}` `{event}`" if event else f"`{cls.TYPE}`"


def _record_table(cls: type) -> list[str]:
    """One record type's section: what it is, then its fields with their JSON types, absent
    value and meaning (the comment beside each in gpuherd/status_records.py)."""
    from gpuherd.status_records import fields_of

    notes = {}
    for owner in reversed(cls.__mro__):  # a field declared in a base (`nan`'s in SuspiciousStep) keeps its comment
        if owner.__module__ == cls.__module__ and owner.__name__ != "object":
            notes.update(source_comments(ROOT / "gpuherd" / "status_records.py", owner.__name__))
    title = f"{cls.TYPE} {cls.EVENT}" if getattr(cls, "EVENT", "") else cls.TYPE
    out = [f"### {title}", "", f"{' '.join((cls.__doc__ or '').split())} (`{cls.__name__}`)", ""]
    own = fields_of(cls)
    if not own:
        return out
    out += ["| field | JSON type | when absent | meaning |", "|---|---|---|---|"]
    for field in own:
        out.append(f"| `{field.name}` | {cell(_JSON_TYPES[field.type])} | {cell(_record_default(field))} "
                   f"| {cell(notes.get(field.name, ''))} |")
    return out + [""]


def _records(classes: tuple, events: dict) -> list[str]:
    rows = ["| type | fields (besides `type`, `rank`, `time`) | meaning |", "|---|---|---|"]
    sections: list[str] = []
    from gpuherd.status_records import fields_of

    for cls in classes:
        kinds = [cls, *events.get(cls, ())]
        for kind in kinds:
            names = ", ".join(f.name for f in fields_of(kind))
            rows.append(f"| {_record_name(kind)} | {cell(names)} | {cell(' '.join((kind.__doc__ or '').split()))} |")
            sections += _record_table(kind)
    return [*rows, "", *sections]


def status_records() -> str:
    from gpuherd.status_channel import PIPE_BUF
    from gpuherd.status_records import LIVE_EVENTS, STATUS_RECORDS, Live

    head = (f"Every record is one line of at most {PIPE_BUF} bytes (`PIPE_BUF`: written atomically) with `type`, "
            "`rank` and `time` (unix seconds); a record that would be longer is sent with those and `truncated: true` "
            "alone. The types are declared in `gpuherd/status_records.py`, which the supervisor decodes each line "
            "with, once: a line that is not JSON, not an object, or of another type is refused (dropped); a field "
            "no type declares is ignored; a null field is not known (its absent value stands); a field of the wrong "
            "type is dropped (its absent value stands) and named in the record's `refused`, and the record still "
            "counts as a sign of life.")
    return "\n".join([head, "", *_records(STATUS_RECORDS, {Live: LIVE_EVENTS})]).rstrip()


def metrics_records() -> str:
    from gpuherd.status_records import SUPERVISOR_RECORDS, TIMELINE_EVENTS, Timeline

    return "\n".join(_records(SUPERVISOR_RECORDS, {Timeline: TIMELINE_EVENTS})).rstrip()


def torchrun_environment() -> str:
    from gpuherd import contract

    return ", ".join(f"`{name}`" for name in contract.TORCHRUN_VARS)


def _help(argv: list[str]) -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal's width: one width for every machine
    if argv == ["--help"]:
        from supervisor.commands.dispatch import usage

        return usage()
    from supervisor.cli import PROG, build_parser

    return build_parser(PROG).format_help().rstrip()


def cli_help() -> str:
    out = []
    for argv, title in ((["--help"], "gpuherd --help"), (["run", "--help"], "gpuherd run --help")):
        out += [f"`{title}`:", "", "```text", _help(argv), "```", ""]
    return "\n".join(out).rstrip()


PAGES: dict[str, tuple[str, Callable[[], str]]] = {
    "exit_codes": ("docs/reference/exit-codes.md", exit_codes),
    "config_keys": ("docs/reference/config.md", config_keys),
    "environment": ("docs/reference/environment.md", environment),
    "status_records": ("docs/reference/status-records.md", status_records),
    "metrics_records": ("docs/reference/status-records.md", metrics_records),
    "environment_torchrun": ("docs/reference/environment.md", torchrun_environment),
    "cli_help": ("docs/reference/cli.md", cli_help),
}


def render(page_text: str, name: str, body: str) -> str:
    begin, end = BEGIN.format(name=name), END.format(name=name)
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(page_text):
        raise SystemExit(f"reference_pages.py: error: no '{begin}' ... '{end}' block to fill")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", page_text)


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose generated block differs from what the code gives now."""
    out = []
    for name, (page, make) in PAGES.items():
        text = (root / page).read_text()
        if render(text, name, make()) != text:
            out.append(f"{page} ({name})")
    return out


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        behind = stale()
        for page in behind:
            print(f"reference_pages.py: stale: {page}; run python scripts/reference_pages.py", file=sys.stderr)
        return 1 if behind else 0
    if argv:
        print("usage: python scripts/reference_pages.py [--check]", file=sys.stderr)
        return 2
    for name, (page, make) in PAGES.items():
        path = ROOT / page
        path.write_text(render(path.read_text(), name, make()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
