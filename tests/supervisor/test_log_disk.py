"""A full or failing log disk: the workers keep training, log lines are dropped with a count, one
WARNING names the disk, and the run ends with its usual summary and exit code."""

from __future__ import annotations

import os
import resource
import subprocess
from pathlib import Path

import orjson

from gpuherd.log_writes import LogWrites
from tests.supervisor import helpers as sh

FILE_LIMIT = 64 * 1024  # RLIMIT_FSIZE: past it every write fails with EFBIG, as on a full disk


def test_a_full_disk_drops_lines_counts_them_and_warns_once():
    warnings: list[str] = []
    writes = LogWrites()
    writes.on_first_failure(warnings.append)
    fd = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    try:
        assert not writes.write(fd, b"one\ntwo\n", Path("/dev/full"))
        assert not writes.write(fd, b"three\n", Path("/dev/full"))
    finally:
        os.close(fd)
    assert writes.dropped == 3
    assert warnings == ["cannot write logs to /dev: no space left on device" + warnings[0].split("device", 1)[1]]
    assert "log lines are dropped (counted) from now on; the workers keep training" in warnings[0]
    assert writes.note().startswith("3 log line(s) could not be written (/dev: no space left on device")


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def test_a_log_file_that_cannot_grow_never_stops_the_run(tmp_path):
    """The case as found, with a file-size limit standing in for the full disk: a worker floods
    its log past what the disk takes; the run still ends 0 with summary.json naming the loss."""
    cmd = sh.command("--nproc", "1", "--run-id", "full", behaviours=("flood:5000",))
    done = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=180,
                          preexec_fn=_limit_file_size)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "cannot start worker" not in done.stderr
    warning = [line for line in done.stderr.splitlines() if "cannot write logs to" in line]
    assert len(warning) == 1 and f"cannot write logs to {tmp_path / 'logs' / 'full'}: file too large" in warning[0]
    assert "flood line 004999 from rank 0" in done.stdout  # the console still shows everything
    log = tmp_path / "logs" / "full" / "worker-rank0-CPU0.log"
    assert log.stat().st_size <= FILE_LIMIT
    summary = orjson.loads((tmp_path / "logs" / "full" / "summary.json").read_bytes())
    assert summary["exit_code"] == 0
    assert any("log line(s) could not be written" in note for note in summary["notes"]), summary["notes"]


def _no_file_over_a_kib() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def test_a_run_directory_that_cannot_take_its_config_is_exit_7_in_one_line(tmp_path):
    """Before any worker starts nothing is lost by stopping: a log disk that cannot take
    config.json (a 1 KiB file-size limit standing in for a full disk) is one line, exit 7."""
    cmd = sh.command("--nproc", "1", "--run-id", "full", behaviours=("train:1",))
    done = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=120,
                          preexec_fn=_no_file_over_a_kib)
    assert done.returncode == 7, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"gpuherd: error: cannot save the run's config to {tmp_path / 'logs' / 'full'}: file too large"), lines
    assert not list((tmp_path / "logs" / "full").glob("worker-rank*.log"))  # no worker was started


def test_a_summary_that_cannot_be_written_goes_to_the_console_whole(tmp_path):
    """The run's end when even summary.json cannot be written (here a directory is in its way):
    one WARNING says so and the summary itself is printed, the run's exit code unchanged."""
    run_dir = tmp_path / "logs" / "nosummary"
    (run_dir / "summary.json" / "in-the-way").mkdir(parents=True)
    cmd = sh.command("--nproc", "1", "--run-id", "nosummary", "--force", behaviours=("train:2",))
    done = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"summary.json could not be written to {run_dir} (" in done.stderr and "): here it is" in done.stderr
    printed = done.stderr[done.stderr.index("): here it is"):]
    summary = orjson.loads(printed[printed.index("{"):printed.index("\n}") + 2])
    assert summary["run_id"] == "nosummary" and summary["exit_code"] == 0
    assert "gpuherd: run nosummary finished" in done.stderr
