"""TORCHELASTIC_ERROR_FILE: each rank's own path, and a rank's @record error as the root cause."""

from __future__ import annotations

import subprocess

import orjson
import pytest

from supervisor.processes.error_file import error_file_for, read_error_file
from tests.supervisor import helpers as sh

RECORDED = """\
import os
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    if os.environ["RANK"] == "1":
        raise RuntimeError("boom from rank 1\\nsecond line")
    time.sleep(60)


if __name__ == "__main__":
    main()
"""


def test_error_file_sits_beside_the_rank_log(tmp_path):
    assert error_file_for(tmp_path / "worker-rank3-GPU5.log") == tmp_path / "worker-rank3-GPU5.error.json"


@pytest.mark.parametrize("content, expected", [
    ({"message": {"message": "ValueError: bad\n  value", "extraInfo": {"py_callstack": "Traceback\n  x\n"}}},
     ("ValueError: bad value", ["Traceback", "  x"])),
    ({"message": "plain text form"}, ("plain text form", [])),
    ({"message": {"message": "x" * 600}}, ("x" * 497 + "...", [])),
    ({"nothing": 1}, None),
    ("garbage", None),
])
def test_read_error_file_takes_torchs_forms(tmp_path, content, expected):
    path = tmp_path / "e.json"
    path.write_bytes(content.encode() if isinstance(content, str) else orjson.dumps(content))
    error = read_error_file(path)
    assert (None if error is None else (error.message, error.traceback)) == expected
    assert read_error_file(tmp_path / "missing.json") is None


def test_a_ranks_record_error_is_the_root_cause_with_its_traceback(tmp_path):
    script = tmp_path / "recorded.py"
    script.write_text(RECORDED)
    cmd = sh.command("--grace-period", "2", script=script)
    result = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    run_dir = sh.run_dir_of(tmp_path)
    cause = orjson.loads((run_dir / "summary.json").read_bytes())["root_cause"]
    assert cause["rank"] == 1 and cause["message"].startswith("CPU1 (rank 1) exit code 1 after ")
    assert cause["message"].endswith(": RuntimeError: boom from rank 1 second line")
    assert any('raise RuntimeError("boom from rank 1' in line for line in cause["traceback"])
    assert "traceback of CPU1 (rank 1), from its error file:" in result.stderr
    assert (run_dir / "worker-rank1-CPU1.error.json").is_file()
    assert not (run_dir / "worker-rank0-CPU0.error.json").exists()  # torn down: nothing to record
