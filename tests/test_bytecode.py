"""The suite's processes read this checkout's bytecode instead of compiling it each (tests/bytecode.py)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from tests.bytecode import PACKAGES, compile_bytecode, writing_bytecode

REPO = Path(__file__).resolve().parents[1]


def _current(source: Path) -> bool:
    """Its bytecode is there and is of this source (the mtime and size Python checks on import)."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.is_file():
        return False
    header, stat = cached.read_bytes()[:16], source.stat()
    return (header[:4] == importlib.util.MAGIC_NUMBER and int.from_bytes(header[8:12], "little") == int(stat.st_mtime)
            & 0xFFFFFFFF and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF)


def test_every_module_of_ours_has_current_bytecode_while_the_tests_run():
    sources = [path for package in PACKAGES for path in (REPO / package).rglob("*.py")]
    stale = [str(path.relative_to(REPO)) for path in sources if not _current(path)]
    assert len(sources) > 300 and not stale, stale[:10]


def test_bytecode_is_written_where_the_environment_says_not_to(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/mod.py"):
        (tmp_path / name).write_text("X = 1\n")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # what PYTHONDONTWRITEBYTECODE=1 sets
    compile_bytecode(tmp_path, ("pkg",))
    assert all(_current(tmp_path / name) for name in ("pkg/__init__.py", "pkg/sub/mod.py"))
    edited = tmp_path / "pkg" / "sub" / "mod.py"
    edited.write_text("X = 22\n")  # its old bytecode no longer matches: an import compiles the source
    assert not _current(edited)
    os.utime(edited, (edited.stat().st_atime, edited.stat().st_mtime + 10))  # compileall checks the mtime alone
    compile_bytecode(tmp_path, ("pkg",))
    assert _current(tmp_path / "pkg" / "sub" / "mod.py")


def test_bytecode_may_be_written_only_inside(monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    with writing_bytecode():
        assert sys.dont_write_bytecode is False
    assert sys.dont_write_bytecode is True
