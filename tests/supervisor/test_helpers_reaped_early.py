"""The launcher's helpers (the orphan guard, the store helper) are reaped while the summary is
written, not after it: on a busy node each exit waits for a time slice, and that wait used to
follow the summary's fsyncs on every exit (issue 49). Real processes: the guard is started and
released as at a run's end; it is reaped (gone, not a zombie) before `reap_helpers` is called."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from supervisor.job import Job
from supervisor.processes.cgroup import DISABLE
from supervisor.processes.orphan_guard import OrphanGuard
from supervisor.rendezvous.store import StoreServer

BOUND_S = 20.0  # generous: a released guard exits at once; a loaded CI runner may take a while to schedule it


class _NoAgent:
    helper_pid = None  # a single-node run: no node agent left to end after the summary


def _job_at_its_end(guard: OrphanGuard, store: StoreServer) -> Job:
    """The part of a Job its end uses: its guard, its store helper, its rendezvous (no agent)."""
    job = Job.__new__(Job)
    job.guard, job._released_guard, job._reaping = guard, None, None
    job.attempts = type("Attempts", (), {"store_server": store})()
    job.rendezvous = _NoAgent()
    return job


def test_the_released_guard_is_reaped_before_the_exit_path_asks_for_it(monkeypatch):
    monkeypatch.setenv(DISABLE, "0")  # leave the test process's cgroup alone
    guard = OrphanGuard("GPUHERD_TEST_MARKER=1", sys.executable, {})
    store = StoreServer(sys.executable, {}, lambda: None)  # never started: nothing to reap
    job = _job_at_its_end(guard, store)
    pid = guard.pid
    job.release_guard()
    deadline = time.monotonic() + BOUND_S
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:  # a zombie still has its /proc entry
        time.sleep(0.01)
    reaped_meanwhile = not Path(f"/proc/{pid}").exists()
    job.reap_helpers()
    job.reap_helpers()  # main.py's finally calls it again: nothing left, nothing waited for
    assert reaped_meanwhile, "the released guard was left unreaped until reap_helpers"
    assert not Path(f"/proc/{pid}").exists()
