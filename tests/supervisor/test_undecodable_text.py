"""A file name with bytes that are not UTF-8 (Latin-1 `caf\\xe9.txt`) quoted in a root cause:
summary.json is still written, showing the bytes as `\\xe9`."""

from __future__ import annotations

import os

import orjson

from gpuherd.exit_codes import ExitCode
from gpuherd.text import one_line, printable
from supervisor.summary import RootCause, Summary


def test_a_summary_quoting_an_undecodable_name_is_still_written(tmp_path):
    name = os.fsdecode(b"/data/caf\xe9.txt")
    cause = RootCause("dataset", ExitCode.DATA, f"dataset: cannot read {name}")
    summary = Summary(run_id="r", run_dir=str(tmp_path), mode="train", command=["x", name], exit_code=3,
                      outcome="dataset", started_at="now", duration_s=0.1, root_cause=cause, workers=[])
    summary.write(tmp_path / "summary.json")
    written = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert written["root_cause"]["message"] == "dataset: cannot read /data/caf\\xe9.txt"
    assert written["command"][1] == printable(name) == "/data/caf\\xe9.txt"


def test_one_line_shows_control_characters_and_undecodable_bytes_as_escapes():
    assert one_line("a\nb\x00c\td") == "a\\nb\\x00c\\td"
    assert one_line("caf\udce9") == "caf\\xe9"  # a non-UTF-8 byte, as printable() shows it
    assert one_line("节点 3: 'ok'") == "节点 3: 'ok'"  # printable text, non-ASCII included, as it is
