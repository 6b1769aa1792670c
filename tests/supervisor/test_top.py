"""`gpuherd top` in a real pseudo-terminal: the rows a user sees, and the rank it highlights."""

from __future__ import annotations

import signal
import sys

import orjson
import psutil
import pytest

from tests.supervisor import helpers as sh
from tests.supervisor.screen import run_in_terminal
from tests.supervisor.helpers import env as run_env

TOP = [sys.executable, "-m", "supervisor.commands.top"]


def last_logged(run_dir, rank: int) -> dict:
    records = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    return [r for r in records if r["type"] == "step" and r["rank"] == rank and r.get("loss") is not None][-1]


@pytest.mark.slow
def test_once_on_a_finished_debug_run_shows_every_rank_with_its_last_step_and_loss(finished_debug_run):
    shown = run_in_terminal([*TOP, str(finished_debug_run), "--once"], finished_debug_run.parent, run_env())
    assert shown.returncode == 0, shown.text()
    assert "finished: success" in shown.text()
    for rank in (0, 1):
        line = shown.lines[shown.row_of(f"CPU{rank} ")]
        record = last_logged(finished_debug_run, rank)
        assert f"{record['loss']:.4f}" in line, line
        assert f"{record['max_steps']}/{record['max_steps']}" in line and "done" in line, line
        assert "red" not in shown.backgrounds(shown.row_of(f"CPU{rank} "))


def test_a_stopped_worker_is_highlighted_with_the_reason(tmp_path):
    proc = sh.start(tmp_path, "forever", "stop", args=("--grace-period", "1", "--hang-timeout", "120"))
    try:
        assert sh.wait_for(lambda: _stopped_worker(tmp_path) is not None, timeout=60)
        run_dir = sh.run_dir_of(tmp_path)
        shown = run_in_terminal([*TOP, "--once"], tmp_path, run_env())
    finally:
        proc.send_signal(signal.SIGTERM)
        sh.finish(proc)
    assert shown.returncode == 0, shown.text()
    assert f"run {run_dir.name}" in shown.text() and "running" in shown.text()
    stopped = shown.row_of("CPU1 ")
    assert "STOPPED" in shown.lines[stopped] and "SIGSTOP" in shown.lines[stopped], shown.text()
    assert "red" in shown.backgrounds(stopped)
    healthy = shown.row_of("CPU0 ")
    assert "STOPPED" not in shown.lines[healthy] and "red" not in shown.backgrounds(healthy)


def _stopped_worker(cwd) -> int | None:
    run_dir = sh.run_dir_of(cwd)
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return None
    for line in (run_dir / "metrics.jsonl").read_bytes().splitlines():
        record = orjson.loads(line)
        if record["type"] == "host" and record["rank"] == 1:
            try:
                if psutil.Process(record["pid"]).status() == psutil.STATUS_STOPPED:
                    return record["pid"]
            except psutil.Error:
                return None
    return None


def test_live_view_follows_the_run_and_ends_with_its_final_frame(tmp_path):
    proc = sh.start(tmp_path, "train:150", "train:150")
    try:
        assert sh.wait_for(lambda: sh.run_dir_of(tmp_path) is not None, timeout=30)
        shown = run_in_terminal([*TOP, "--interval", "0.2"], tmp_path, run_env(), timeout=60)
    finally:
        code, _out, err = sh.finish(proc)
    assert code == 0, err[-2000:]
    assert shown.returncode == 0
    assert "finished: success" in shown.text(), shown.text()
    for rank in (0, 1):
        assert "150/150" in shown.lines[shown.row_of(f"CPU{rank} ")]


def test_a_run_that_does_not_exist_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "logs").mkdir()
    shown = run_in_terminal([*TOP, "nope", "--logs", str(tmp_path / "logs")], tmp_path, run_env())
    assert shown.returncode == 2
    assert [line for line in shown.lines if line] == [
        f"gpuherd top: error: run 'nope' not found (neither a directory nor a run id under {tmp_path / 'logs'})"]
