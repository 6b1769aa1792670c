"""Earlier runs' cgroups left behind (their whole process tree SIGKILLed at once, the orphan
guard with it) are removed when the next run makes its own, and what still lived in them is
killed; a live run's never is."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from supervisor.processes.cgroup import cgroup2_mount, own_cgroup_path, remove_stale_run_cgroups

DEAD = 2**22 + 12345  # above every pid_max Linux allows: no such process


def test_an_empty_cgroup_of_a_dead_supervisor_is_removed_and_nothing_else(tmp_path):
    stale = tmp_path / f"gpuherd-{DEAD}"
    busy = tmp_path / f"gpuherd-{DEAD + 1}"  # still holds something: the kernel refuses rmdir
    live = tmp_path / f"gpuherd-{os.getppid()}"
    mine = tmp_path / f"gpuherd-{os.getpid()}"
    other = tmp_path / "someone-else"
    for d in (stale, busy, live, mine, other):
        d.mkdir()
    (busy / "cgroup.procs").write_text("1\n")
    assert remove_stale_run_cgroups(tmp_path) == [stale]
    assert not stale.exists() and busy.exists() and live.exists() and mine.exists() and other.exists()


def test_a_name_that_is_not_a_pid_is_left_alone(tmp_path):
    odd = tmp_path / "gpuherd-notapid"
    odd.mkdir()
    assert remove_stale_run_cgroups(tmp_path) == [] and odd.exists()


def _own_cgroup() -> Path | None:
    """This process's cgroup v2 directory, where it can be written (root, a v2 hierarchy)."""
    try:
        mount = cgroup2_mount(Path("/proc/self/mounts").read_text())
        here = own_cgroup_path(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    if mount is None or here is None:
        return None
    parent = mount / here.lstrip("/")
    return parent if os.access(parent, os.W_OK) and (parent / "cgroup.procs").exists() else None


def test_what_outlived_a_dead_run_in_its_cgroup_is_killed_and_the_cgroup_removed():
    """The supervisor and its orphan guard SIGKILLed together: a setsid() grandchild lived on in
    the run's cgroup. The next run's start kills it and removes the cgroup."""
    parent = _own_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup v2 here")
    group = parent / f"gpuherd-{DEAD}"
    group.mkdir()
    leftover = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        (group / "cgroup.procs").write_text(f"{leftover.pid}\n")
        # another test's run starting on this host meanwhile may do it first, and a run another test
        # SIGKILLed whole may have left a cgroup of its own: this one is removed either way
        removed = remove_stale_run_cgroups(parent)
        assert group in removed or not group.exists(), removed
        assert all(path.parent == parent and path.name.startswith("gpuherd-") for path in removed), removed
        assert leftover.wait(timeout=5) == -signal.SIGKILL
        assert not group.exists()
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()
        if group.exists():
            group.rmdir()
