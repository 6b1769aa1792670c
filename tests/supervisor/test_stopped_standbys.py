"""A restart handed to stopped standbys (issue 43, part 3), as it was found: a `--script` run's
restart standbys SIGSTOPped (a cgroup freezer, an operator's Ctrl-Z), then rank 1 SIGKILLed.
With both stopped, attempt 1 went to the stopped standbys and nothing was said until the startup
allowance (300 s); with one, the stopped rank was named a hang after 4 s and that cost one of
--max-restarts (here the last: the run failed, exit 124). A standby the kernel shows stopped is
never handed a rank: it is killed and reaped, said in one line, and its rank starts afresh."""

from __future__ import annotations

import signal
import sys

import psutil
import pytest

from gpuherd import contract
from supervisor.gpus import DeviceSlot
from supervisor.health import HangPolicy, Heartbeats, LearnedTimeouts, ProcSample
from supervisor.processes.spawn import spawn
from supervisor.processes.standbys import Standbys
from tests.supervisor.helpers import finish, start, wait_for

# torchrun-style: a gloo group, an optimizer step (the first one starts the standbys) and an
# all_reduce per step; the first attempt runs until rank 1 is killed, the next one takes 3 steps
SCRIPT = """\
import os, time
import torch
import torch.distributed as dist
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
dist.init_process_group("gloo")
opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
t = torch.ones(1)
for _ in range(600 if restart == "0" else 3):
    opt.step()
    dist.all_reduce(t)
    time.sleep(0.1)
print(f"restart {restart} rank {dist.get_rank()} done", flush=True)
dist.destroy_process_group()
"""


def _children(pid: int) -> list[tuple[psutil.Process, dict[str, str]]]:
    found = []
    for child in psutil.Process(pid).children():
        try:
            found.append((child, child.environ()))
        except psutil.Error:
            continue
    return found


def _standbys(pid: int) -> list[psutil.Process]:
    return [p for p, env in _children(pid) if env.get(contract.STANDBY) == "1"]


def _ranks(pid: int) -> list[psutil.Process]:
    return [p for p, env in _children(pid) if "RANK" in env]


def test_a_stopped_standby_is_killed_and_its_rank_starts_afresh(tmp_path):
    waiter = "import sys\nsys.stdin.buffer.readline()\n"
    standbys, slot = Standbys(), DeviceSlot(1, "cpu", 1)
    [standby] = standbys.fill([slot], lambda s: (spawn([sys.executable, "-c", waiter], lambda fd: {"PATH": ""}, s,
                                                       tmp_path / "rank.log", stdin_pipe=True), {}))
    standby.signal_group(signal.SIGSTOP)
    assert wait_for(lambda: psutil.Process(standby.pid).status() == psutil.STATUS_STOPPED, timeout=10)
    assert standbys.take(slot, {}, tmp_path / "attempt-1.log") is None  # not handed the rank
    assert standby.popen.returncode == -signal.SIGKILL and not psutil.pid_exists(standby.pid)  # killed, reaped


def test_a_stopped_standby_is_never_lent_to_a_scripts_live_recovery(tmp_path):
    """A script's live recovery borrows the oldest standby when its own spare is younger: a
    stopped one would hold the rebuilt group; it is killed and reaped, and the next one lent."""
    waiter = "import sys\nsys.stdin.buffer.readline()\n"
    standbys, slots = Standbys(), [DeviceSlot(0, "cpu", 0), DeviceSlot(1, "cpu", 1)]
    stopped, running = standbys.fill(slots, lambda s: (spawn([sys.executable, "-c", waiter], lambda fd: {"PATH": ""}, s,
                                                             tmp_path / f"rank{s.local}.log", stdin_pipe=True), {}))
    stopped.signal_group(signal.SIGSTOP)
    assert wait_for(lambda: psutil.Process(stopped.pid).status() == psutil.STATUS_STOPPED, timeout=10)
    assert standbys.lend(before=float("inf")) is running  # the stopped (older) one passed over
    assert stopped.popen.returncode == -signal.SIGKILL and not psutil.pid_exists(stopped.pid)
    running.discard()


def _stop_standbys_then_kill_rank1(supervisor: int, stopped: int) -> list[psutil.Process]:
    """Once both restart standbys are up: SIGSTOP `stopped` of them, then SIGKILL rank 1."""
    assert wait_for(lambda: len(_standbys(supervisor)) == 2, timeout=90), "no restart standbys started"
    standbys = _standbys(supervisor)
    for standby in standbys[:stopped]:
        standby.send_signal(signal.SIGSTOP)
    assert wait_for(lambda: all(s.status() == psutil.STATUS_STOPPED for s in standbys[:stopped]), timeout=10)
    [rank1] = [p for p, env in _children(supervisor) if env.get("RANK") == "1" and contract.STANDBY not in env]
    rank1.send_signal(signal.SIGKILL)
    return standbys


@pytest.mark.parametrize("stopped", [2, 1])
def test_a_restart_never_goes_to_stopped_standbys(tmp_path, stopped):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = start(tmp_path, args=("--nproc", "2", "--max-restarts", "1", "--restart-backoff", "0.2",
                                 "--grace-period", "2"), script=script)
    try:
        standbys = _stop_standbys_then_kill_rank1(proc.pid, stopped)
    finally:  # generous: a fresh start imports torch; before the fix, two stopped standbys held the
        # restart for the 300 s startup allowance, one cost the last restart (exit 124)
        code, out, err = finish(proc, timeout=90)
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        assert f"CPU{rank}:restart 1 rank {rank} done" in out + err
    said = [line for line in err.splitlines() if "restart standby of local rank" in line]
    assert len(said) == stopped and all("process stopped (state T); killed" in line for line in said)
    assert "after 1 restart(s)" in err  # the stopped standby cost no restart of its own
    assert not any(psutil.pid_exists(s.pid) for s in standbys)  # killed and reaped: no orphan


# ---- an attempt whose ranks are stopped before their first record is bounded and named

def _script_heartbeats(startup: float = 20.0) -> Heartbeats:
    policy = HangPolicy(step_default=10, startup=startup, factor=5, floor=10)
    return Heartbeats([0, 1], 0.0, LearnedTimeouts(policy), rendezvous=600, expect_heartbeats=False)


def test_ranks_stopped_before_their_first_record_are_said_and_named_after_the_startup_allowance():
    hb = _script_heartbeats()
    stopped = [ProcSample(0, "T", 1.0), ProcSample(1, "T", 1.0)]
    assert hb.check(50.0, {0, 1}, stopped) is None  # a script's ranks may send no record: no clock before this
    assert hb.check(53.5, {0, 1}, stopped) is None and hb.notices == [
        "every running rank is stopped (state T): rank 0 (no record yet), rank 1 (no record yet); taken for a pause "
        "someone made (Ctrl-Z, a cgroup freezer): a verdict in 16 s at the latest unless one runs again"]
    hb.notices.clear()
    assert hb.check(69.0, {0, 1}, stopped) is None and hb.notices == []  # said once
    verdict = hb.check(70.5, {0, 1}, stopped)
    assert verdict is not None and verdict.kind == "hang"
    assert verdict.message.startswith("hang: rank 0, rank 1 (the kernel shows it cannot run)")
    assert "process stopped (state T) for 20 s" in verdict.message


def test_ranks_stopped_together_but_seen_in_two_reads_are_not_taken_for_one_stopped_rank():
    """The first stop's SIGCHLD can wake the supervisor before the second rank is stopped: /proc
    shows rank 1 in T a read later. Rank 0 alone past 3 s is not "stopped while the others run"."""
    hb = _script_heartbeats()
    assert hb.check(50.0, {0, 1}, [ProcSample(0, "T", 1.0), ProcSample(1, "S", 1.0)]) is None
    assert hb.check(50.3, {0, 1}, [ProcSample(0, "T", 1.0), ProcSample(1, "T", 1.0)]) is None
    assert hb.check(53.0, {0, 1}, [ProcSample(0, "T", 1.0), ProcSample(1, "T", 1.0)]) is None
    assert hb.check(53.4, {0, 1}, [ProcSample(0, "T", 1.0), ProcSample(1, "T", 1.0)]) is None
    assert [n.split(";")[0] for n in hb.notices] == [
        "every running rank is stopped (state T): rank 0 (no record yet), rank 1 (no record yet)"]
    verdict = hb.check(70.5, {0, 1}, [ProcSample(0, "T", 1.0), ProcSample(1, "T", 1.0)])
    assert verdict is not None and verdict.message.startswith("hang: rank 0, rank 1 (the kernel shows it cannot run)")


def test_a_script_rank_that_runs_without_records_is_still_left_alone():
    hb = _script_heartbeats()
    for now in (50.0, 100.0, 400.0):
        assert hb.check(now, {0, 1}, [ProcSample(0, "S", 1.0), ProcSample(1, "R", now)]) is None
    assert hb.notices == []


# Sleeps before its first step: a script's rank that sends no record yet
SLEEPER = "import time\ntime.sleep(600)\n"


def test_an_attempt_stopped_before_its_first_record_ends_named_after_the_startup_allowance(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = start(tmp_path, args=("--nproc", "2", "--set", "system.startup_timeout=4", "--grace-period", "2"),
                 script=script)
    try:
        assert wait_for(lambda: len(_ranks(proc.pid)) == 2, timeout=60)
        for rank in _ranks(proc.pid):  # the ranks only: the orphan guard and the store helper run on
            rank.send_signal(signal.SIGSTOP)
    finally:  # before the fix: never judged (no record, none expected), the run sat there for good
        code, _, err = finish(proc, timeout=60)
    assert code == 124, err[-3000:]
    assert "every running rank is stopped (state T): rank 0 (no record yet), rank 1 (no record yet)" in err, err[-3000:]
    assert "root cause: hang: rank 0, rank 1 (the kernel shows it cannot run)" in err, err[-3000:]
