"""Earlier runs' cgroups left behind (their whole process tree SIGKILLed at once, the orphan
guard with it) are removed when the next run makes its own; a live run's never is."""

from __future__ import annotations

import os

from supervisor.processes.cgroup import remove_stale_run_cgroups

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
