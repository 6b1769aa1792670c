"""At a run's end the launcher leaves its run's cgroup while the store helper is still dying, not
after it was reaped (issue 49): the first move of a process between cgroups in a while waits for
an RCU grace period in the kernel (about 10 ms here), and that wait used to follow the helper's
death on every exit. Real processes and a real cgroup, in a child interpreter (the test process
never changes cgroup): the "store helper" is a live `sleep` the reaper waits for; while it still
runs the child must already be back in the cgroup it came from. Then the helper dies, and the
guard, the helper and the run's cgroup are all gone when `reap_helpers` returns. And a run that
ends with its attempt (no restart left) leaves the cgroup earlier still: as its teardown begins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.supervisor import helpers as sh
from tests.supervisor.test_cgroup_stale import _own_cgroup

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, subprocess, sys, time
from pathlib import Path
from supervisor.job import Job
from supervisor.processes.orphan_guard import OrphanGuard
from supervisor.rendezvous.store import StoreServer

BOUND_S = 20.0  # generous: a loaded CI runner may take a while to schedule the reaper
start = Path("/proc/self/cgroup").read_text()
guard = OrphanGuard("GPUHERD_TEST_MARKER=1", sys.executable, {})
assert guard.cgroup is not None, "no run cgroup made"
assert Path("/proc/self/cgroup").read_text() != start  # inside the run's cgroup now
store = StoreServer(sys.executable, {}, lambda: None)
helper = store._dying = subprocess.Popen(["sleep", "60"])  # a helper still dying: its reap waits
job = Job.__new__(Job)
job.guard, job._released_guard, job._reaping = guard, None, None
job.attempts = type("Attempts", (), {"store_server": store})()
job.rendezvous = type("NoAgent", (), {"helper_pid": None})()
job.release_guard(dying=helper.pid)  # as Job.run hands it the store helper it just SIGKILLed
deadline = time.monotonic() + BOUND_S
while Path("/proc/self/cgroup").read_text() != start and time.monotonic() < deadline:
    time.sleep(0.01)
out_while_dying = Path("/proc/self/cgroup").read_text() == start and store._dying is not None
helper.kill()
job.reap_helpers()
print("out while the helper was dying:", out_while_dying)
print("run cgroup removed:", not guard.cgroup.exists())
print("guard reaped:", not Path(f"/proc/{guard.pid}").exists())
"""


def test_the_run_cgroup_is_left_while_the_store_helper_is_still_dying():
    if _own_cgroup() is None:
        pytest.skip("no writable cgroup v2 here")
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "out while the helper was dying: True" in done.stdout, done.stdout
    assert "run cgroup removed: True" in done.stdout and "guard reaped: True" in done.stdout, done.stdout


# rank 1 fails once both ranks are up; rank 0, asked to stop, looks at its parent (the launcher)
# and itself before it exits: where each is while a worker of the last attempt still runs
TORN_DOWN = r"""import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["RANK"]

def on_sigterm(signum, frame):
    run_cgroup = f"gpuherd-{os.getppid()}"
    deadline = time.monotonic() + 10  # generous: on a loaded runner the launcher's move may come late
    while run_cgroup in Path(f"/proc/{os.getppid()}/cgroup").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    (out / "launcher.cgroup").write_text(Path(f"/proc/{os.getppid()}/cgroup").read_text())
    (out / "rank0.cgroup").write_text(Path("/proc/self/cgroup").read_text())
    (out / "run.cgroup").write_text(run_cgroup)
    os._exit(0)

signal.signal(signal.SIGTERM, on_sigterm)
(out / f"up{rank}").touch()
while len(list(out.glob("up*"))) < 2:
    time.sleep(0.01)
if rank == "1":
    sys.exit(1)
time.sleep(60)
"""


def test_a_run_that_ends_with_this_failure_leaves_its_cgroup_while_its_workers_are_torn_down(tmp_path):
    """No restart can follow (--max-restarts 0, the default): the launcher leaves the run's cgroup
    the moment the failure is decided, while rank 0 still handles its SIGTERM, which stays in the
    cgroup (the guard could still kill it); at the exit the cgroup is gone."""
    parent = _own_cgroup()
    if parent is None:
        pytest.skip("no writable cgroup v2 here")
    script = tmp_path / "torn_down.py"
    script.write_text(TORN_DOWN)
    cmd = [*sh.command("--nproc", "2", "--grace-period", "20", script=None), "--script", str(script), str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=sh.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, _, err = sh.finish(proc, timeout=90)
    assert code == 1, err[-3000:]
    run_cgroup = (tmp_path / "run.cgroup").read_text()
    assert run_cgroup not in (tmp_path / "launcher.cgroup").read_text(), "the launcher was still in the run's cgroup"
    assert run_cgroup in (tmp_path / "rank0.cgroup").read_text()  # its workers never leave it
    assert not (parent / run_cgroup).exists()  # removed before the exit code came
