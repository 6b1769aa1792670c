"""The suite-cost tables (`python -m tests.cpu_seconds PATH`): files ranked by their tests' CPU
seconds, then the costliest tests, a test measured twice counted once (its last line)."""

from __future__ import annotations

import orjson

from tests.cpu_seconds import main, tables

ROWS = [
    {"test": "tests/a/test_x.py::test_cheap", "cpu_s": 1.0, "wall_s": 9.0},
    {"test": "tests/a/test_x.py::test_dear", "cpu_s": 5.0, "wall_s": 7.0},
    {"test": "tests/b/test_y.py::test_one[2]", "cpu_s": 8.0, "wall_s": 30.0},
    {"test": "tests/a/test_x.py::test_cheap", "cpu_s": 2.0, "wall_s": 3.0},  # measured again
]


def test_files_are_ranked_by_cpu_seconds_and_a_test_measured_twice_counts_once():
    text = tables(ROWS, top=2)
    assert text.splitlines()[0] == "15 CPU s over 3 tests in 2 files"
    files = [line for line in text.splitlines() if line.startswith("| tests/") and line.count("|") == 6]
    assert files == ["| tests/b/test_y.py | 1 | 8.0 | 53.3% | test_one[2] (8.0) |",
                     "| tests/a/test_x.py | 2 | 7.0 | 46.7% | test_dear (5.0) |"]
    tests = [line for line in text.splitlines() if line.startswith("| tests/") and line.count("|") == 4]
    assert tests == ["| tests/b/test_y.py::test_one[2] | 8.0 | 30.0 |", "| tests/a/test_x.py::test_dear | 5.0 | 7.0 |"]


def test_the_command_reads_the_json_lines_the_plugin_writes(tmp_path, capsys):
    path = tmp_path / "cpu.jsonl"
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in ROWS) + b"\n")
    assert main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("15 CPU s over 3 tests in 2 files") and "tests/a/test_x.py::test_dear" not in out
