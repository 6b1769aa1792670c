"""No orphaned processes, ever: a rank's child that daemonises (setsid(), a second fork, an
empty environment) is killed with a SIGKILLed supervisor, by the run's cgroup where one can be
had and by the recorded process tree otherwise; a run that ends normally leaves no cgroup."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.supervisor import helpers as sh

RANK = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve("/bin/sleep", ["sleep", "300"], {})
    os._exit(0)
open(sys.argv[1], "w").write("daemon started")
time.sleep(300)
"""


def _daemons(tmp_path: Path) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if p.info["cmdline"] == ["sleep", "300"] and p.info["cwd"] == str(tmp_path):
                found.append(p)
        except psutil.Error:
            continue
    return found


def _cgroups(pid: int) -> list[Path]:
    return [p for p in Path("/sys/fs/cgroup").glob(f"**/gpuherd-{pid}") if p.is_dir()]


@pytest.mark.parametrize("cgroup", ["1", "0"])
def test_a_daemonised_grandchild_dies_with_a_sigkilled_supervisor(tmp_path, cgroup):
    (tmp_path / "rank.py").write_text(RANK)
    env = {**sh.env(), "GPUHERD_CGROUP": cgroup}
    proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report",
                             "--nproc", "1", "--script", "rank.py", str(tmp_path / "started")], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert sh.wait_for(lambda: (tmp_path / "started").exists() and _daemons(tmp_path), timeout=60)
        (daemon,) = _daemons(tmp_path)
        assert daemon.ppid() == proc.pid and "GPUHERD_SUPERVISOR_PID" not in daemon.environ()  # escaped the group
        sh.wait_for(lambda: False, timeout=0.5)  # the tree is recorded every 0.2 s without a cgroup
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        gone = sh.wait_for(lambda: not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE, timeout=10)
    finally:
        for p in _daemons(tmp_path):
            p.kill()
    assert gone, "the daemonised grandchild outlived its supervisor"
    assert sh.wait_for(lambda: not _cgroups(proc.pid), timeout=10)


def test_a_run_that_ends_normally_leaves_no_cgroup(tmp_path):
    done = subprocess.run(sh.command("--nproc", "1", behaviours=("exit:0",)), cwd=tmp_path, env=sh.env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    left = lambda: [p for p in Path("/sys/fs/cgroup").glob("**/gpuherd-*")  # noqa: E731
                    if p.is_dir() and not psutil.pid_exists(int(p.name.split("-")[1]))]
    assert sh.wait_for(lambda: not left(), timeout=10), left()
