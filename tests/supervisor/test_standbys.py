"""Restart standbys (supervisor/processes/standbys.py) with real processes: one is promoted with
the new attempt's environment only where that differs in per-attempt variables alone; a standby
that died, or whose environment would differ where an import reads it, makes way for a fresh
start; none is left running at the job's end."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import orjson
import psutil

from gpuherd import contract
from supervisor.gpus import DeviceSlot
from supervisor.processes.spawn import spawn
from supervisor.processes.standbys import Standbys, differences, standby_env

# Stands in for the bootstrap's standby: waits for its assignment, then prints it.
WAITER = ("import sys\n"
          "line = sys.stdin.buffer.readline()\n"
          "if not line.strip():\n"
          "    raise SystemExit(0)\n"
          "sys.stdout.buffer.write(line); sys.stdout.flush()\n")
BASE = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "RANK": "1", "MASTER_PORT": "1000",
        "TORCHELASTIC_RESTART_COUNT": "0", contract.STANDBY: "1"}
SLOT = DeviceSlot(1, "cpu", 1)


def _started(tmp_path: Path, env: dict[str, str] = BASE):
    def start(slot: DeviceSlot):
        process = spawn([sys.executable, "-c", WAITER], lambda fd: {**env, contract.STATUS_FD: str(fd)}, slot,
                        tmp_path / "rank.log", stdin_pipe=True)
        return process, dict(env)
    return start


def _read_all(process, limit_s: float = 20.0) -> bytes:
    got, deadline = b"", time.monotonic() + limit_s
    while process.popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    while chunk := _nonblocking_read(process.popen.stdout.fileno()):
        got += chunk
    return got


def _nonblocking_read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def test_a_standby_is_no_rank_until_it_is_promoted():
    env = standby_env({"RANK": "1", "GROUP_RANK": "0", "ROLE_RANK": "1", "LOCAL_RANK": "1", "OMP_NUM_THREADS": "1"})
    assert env == {"LOCAL_RANK": "1", "OMP_NUM_THREADS": "1", contract.STANDBY: "1"}


def test_only_per_attempt_variables_may_differ():
    after = {**BASE, "RANK": "0", "MASTER_PORT": "2000", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert differences(BASE, after) == []
    assert differences(BASE, {**after, "OMP_NUM_THREADS": "2"}) == ["OMP_NUM_THREADS"]
    assert differences(BASE, {**after, "CUDA_VISIBLE_DEVICES": "3"}) == ["CUDA_VISIBLE_DEVICES"]


def test_a_standby_is_promoted_with_the_new_attempts_environment(tmp_path):
    standbys = Standbys()
    [first] = standbys.fill([SLOT], _started(tmp_path))
    assert standbys.fill([SLOT], _started(tmp_path)) == []  # one per local rank
    wanted = {**BASE, "MASTER_PORT": "2000", "TORCHELASTIC_RESTART_COUNT": "1", contract.STATUS_FD: "99"}
    worker = standbys.take(SLOT, wanted, tmp_path / "attempt-1.log")
    assert worker is not None and worker.pid == first.pid and worker.log_path == tmp_path / "attempt-1.log"
    handed = orjson.loads(_read_all(worker))["env"]
    assert handed == {k: v for k, v in wanted.items() if k not in (contract.STATUS_FD, contract.STANDBY)}
    assert worker.poll() == 0 and standbys.pids() == set()


def test_a_changed_import_time_variable_ends_the_standby_for_a_fresh_start(tmp_path):
    standbys = Standbys()
    [standby] = standbys.fill([SLOT], _started(tmp_path))
    assert standbys.take(SLOT, {**BASE, "OMP_NUM_THREADS": "2"}, tmp_path / "x.log") is None
    assert standby.popen.returncode is not None and not psutil.pid_exists(standby.pid)  # ended and reaped


def test_a_standby_that_died_is_not_used_and_is_replaced(tmp_path):
    standbys = Standbys()
    [standby] = standbys.fill([SLOT], _started(tmp_path))
    standby.signal_group(9)
    standby.popen.wait()
    [again] = standbys.fill([SLOT], _started(tmp_path))  # the next fill starts a new one
    assert again.pid != standby.pid
    again.signal_group(9)
    again.popen.wait()
    assert standbys.take(SLOT, BASE, tmp_path / "x.log") is None


def test_the_jobs_end_retires_every_standby(tmp_path):
    standbys = Standbys()
    started = standbys.fill([SLOT, DeviceSlot(2, "cpu", 2)], _started(tmp_path))
    pgids = standbys.retire()
    assert sorted(pgids) == sorted(s.pgid for s in started)
    assert all(s.popen.returncode == 0 for s in started)  # told by end of input, exited by themselves
    assert not any(psutil.pid_exists(s.pid) for s in started)
