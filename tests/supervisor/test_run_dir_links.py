"""`--force` and planted symbolic links: a run directory that is a link, or holds one, is refused
in one line (exit 2) and nothing is written outside the run directory, as found with
`logs/<run-id>` linked to a directory of links to a victim's files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpuherd.files import open_log
from tests.supervisor import helpers as sh

VICTIM_FILES = ("supervisor.log", "metrics.jsonl", "worker-rank0-CPU0.log")


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.mkdir()
    for name in VICTIM_FILES:
        (victim / name).write_text(f"the victim's own {name}\n")
    return victim


def _run_forced(cwd: Path) -> subprocess.CompletedProcess:
    cmd = sh.command("--nproc", "1", "--run-id", "myrun", "--force", behaviours=("train:1",))
    return subprocess.run(cmd, cwd=cwd, env=sh.env(), capture_output=True, text=True, timeout=120)


def _untouched(victim: Path) -> None:
    for name in VICTIM_FILES:
        assert (victim / name).read_text() == f"the victim's own {name}\n"
    assert not (victim / "config.json").exists() and not (victim / "summary.json").exists()


def test_a_run_directory_that_is_a_link_is_refused_never_followed(tmp_path):
    victim = _victim(tmp_path)
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    for name in VICTIM_FILES:
        (decoy / name).symlink_to(victim / name)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "myrun").symlink_to(decoy)
    done = _run_forced(tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"run directory {tmp_path / 'logs' / 'myrun'} is a symbolic link (to {decoy})" in lines[0]
    _untouched(victim)
    assert sorted(p.name for p in decoy.iterdir()) == sorted(VICTIM_FILES)


@pytest.mark.parametrize("planted", ["metrics.jsonl", "worker-rank0-CPU0.log", "supervisor.log"])
def test_a_reused_run_directory_holding_a_link_is_refused(tmp_path, planted):
    victim = _victim(tmp_path)
    run_dir = tmp_path / "logs" / "myrun"
    run_dir.mkdir(parents=True)
    (run_dir / planted).symlink_to(victim / planted)
    done = _run_forced(tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"holds a symbolic link, {run_dir / planted} (to {victim / planted})" in lines[0]
    _untouched(victim)


def test_log_files_are_never_opened_through_a_link(tmp_path):
    victim = _victim(tmp_path)
    (tmp_path / "planted.log").symlink_to(victim / "supervisor.log")
    with pytest.raises(OSError):
        open_log(tmp_path / "planted.log")
    os.close(open_log(tmp_path / "fresh.log"))
    _untouched(victim)


def test_force_still_reuses_a_plain_run_directory(tmp_path):
    for _ in range(2):
        done = _run_forced(tmp_path)
        assert done.returncode == 0, done.stderr
    log = (tmp_path / "logs" / "myrun" / "worker-rank0-CPU0.log").read_text()
    assert log.count("Step [0/1]") == 2  # appended, as --force always did
