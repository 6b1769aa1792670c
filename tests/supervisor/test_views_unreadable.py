"""`gpuherd top` and `gpuherd report` read whatever a crashed, full or hostile run left behind:
what they cannot use is skipped and counted, never a traceback."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import orjson
import pytest

from gpuherd.status_channel import PIPE_BUF, StatusWriter
from supervisor.commands import report as report_command
from supervisor.commands import top as top_command
from supervisor.output import Console, LogRouter, WorkerLog, WorkerPipes
from tests.supervisor import helpers as sh
from worker.main import guarded

CONFIG = {"training": {"batch_size": 4, "grad_accum_nums": 2, "max_restarts": 0}, "data": {"context_length": 128}}


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "logs" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_bytes(orjson.dumps(CONFIG))
    return run_dir


def _through_the_status_channel(run_dir: Path, body) -> None:
    """The worker's own failure path (`worker.main.guarded`) sends on a real status pipe; the
    supervisor's pipe reader appends what it decodes to metrics.jsonl, as in a run."""
    metrics = run_dir / "metrics.jsonl"
    status_r, status_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    log = WorkerLog(0, "CPU0", run_dir / "worker-rank0-CPU0.log")
    console = Console(notice_fd=err_w)
    pipes = WorkerPipes(LogRouter([log], console), on_record=lambda *_: None,
                        write_metrics=lambda data: metrics.open("ab").write(data))
    pipes.add(0, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"), status_r)
    writer = StatusWriter(status_w, rank=0)
    writer.send("step", step=1, max_steps=5, loss=2.5, tokens_per_s=100.0)
    guarded(body, writer)
    for fd in (status_w, out_w, err_w):
        os.close(fd)
    pipes.close()
    console.close()
    log.close()


def _top(run_dir: Path) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert top_command.main([str(run_dir), "--once", "--width", "250"]) == 0
    return out.getvalue()


def _report(run_dir: Path) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert report_command.main([str(run_dir)]) == 0
    return (run_dir / "report" / "report.html").read_text()


def test_a_long_non_ascii_error_that_the_status_channel_truncated(tmp_path):
    """Before: IndexError in events.py; 2,000 non-ASCII characters (the worker's own cut)
    are over 4 KB, so the channel sent the record without its message."""
    run_dir = _run_dir(tmp_path)

    def fails():
        raise RuntimeError("节点 3 不再响应。" * 300)

    _through_the_status_channel(run_dir, fails)
    records = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    error = records[-1]
    assert error["type"] == "error" and error.get("truncated") and "message" not in error  # as found
    assert len(("节点 3 不再响应。" * 300)[:2000].encode()) > PIPE_BUF
    screen = _top(run_dir)
    assert "FAILED" in screen and "too long for the status channel" in screen
    assert "rank 0: error (its message was too long for the status channel" in _report(run_dir)


GARBAGE = [
    b"not json at all",
    b"\xff\xfe\x00 binary",
    b"[1, 2, 3]",
    b'"a string"',
    b'{"type": "error", "rank": 1, "time": 5.0, "message": ""}',  # readable: an empty message
    b'{"type": "step", "rank": 0, "time": 6.0, "step": "seven", "loss": 1.0}',
    b'{"type": "step", "rank": 0, "time": 6.0, "step": [7], "loss": 1.0}',
    b'{"type": "spike", "rank": 0, "time": 6.0, "step": {"a": 1}}',
    b'{"type": "nan", "rank": 0, "time": 1e300, "step": 3}',
    b'{"type": "step", "rank": true, "time": 6.0, "step": 2, "loss": 1.0}',
    b'{"type": "host", "rank": 0, "time": 6.0, "pid": "self", "rss": "big"}',
    b'{"type": "checkpoint", "rank": 0, "time": 6.0, "step": 4, "stall_s": "slow", "path": 7}',
    b'{"type": "step", "rank": 0, "time": 7.0, "step": 3, "max_steps": 5, "loss": 2.0}',
    b'{"type": "restart", "time": null, "attempt": 1}',
]


@pytest.mark.parametrize("view", ["top", "report"])
def test_garbage_lines_in_metrics_are_skipped_and_counted(tmp_path, view):
    """Before: ValueError/TypeError (`int("seven")`, an unhashable step, ...) in report_data.py
    and events.py; now every line that cannot be used is skipped, and the view says how many."""
    run_dir = _run_dir(tmp_path)
    good = orjson.dumps({"type": "step", "rank": 0, "time": 1.0, "step": 1, "max_steps": 5, "loss": 2.5}) + b"\n"
    (run_dir / "metrics.jsonl").write_bytes(good + b"\n".join(GARBAGE) + b"\n")
    unreadable = 11  # every line above but the empty error, the last step and the restart
    if view == "top":
        screen = _top(run_dir)
        assert f"{unreadable} unreadable line(s) in metrics.jsonl skipped" in screen
        assert "3/5" in screen  # rank 0's last readable step
        assert "error (no message)" in screen  # rank 1's empty error, shown as such
    else:
        page = _report(run_dir)
        assert f"<td>unreadable lines in metrics.jsonl (skipped)</td><td>{unreadable}</td>" in page
        assert "rank 1: error (no message)" in page


@pytest.mark.parametrize("name", ["metrics.jsonl", "supervisor.log"])
def test_a_named_pipe_for_an_appended_file_is_named_not_waited_on(tmp_path, name):
    """Before: both views opened it and waited for a writer that never came."""
    run_dir = _run_dir(tmp_path)
    os.mkfifo(run_dir / name)
    done = subprocess.run([sys.executable, "-m", "supervisor.commands.top", str(run_dir), "--once", "--width", "250"],
                          env=sh.env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"not read, no regular file: {name} (a named pipe)" in done.stdout
    done = subprocess.run([sys.executable, "-m", "supervisor.commands.report", str(run_dir)], env=sh.env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert f"<td>{name} (a named pipe)</td>" in (run_dir / "report" / "report.html").read_text()
