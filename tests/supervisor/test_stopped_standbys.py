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


def test_a_stopped_standby_is_killed_and_its_rank_starts_afresh(tmp_path):
    waiter = "import sys\nsys.stdin.buffer.readline()\n"
    standbys, slot = Standbys(), DeviceSlot(1, "cpu", 1)
    [standby] = standbys.fill([slot], lambda s: (spawn([sys.executable, "-c", waiter], lambda fd: {"PATH": ""}, s,
                                                       tmp_path / "rank.log", stdin_pipe=True), {}))
    standby.signal_group(signal.SIGSTOP)
    assert wait_for(lambda: psutil.Process(standby.pid).status() == psutil.STATUS_STOPPED, timeout=10)
    assert standbys.take(slot, {}, tmp_path / "attempt-1.log") is None  # not handed the rank
    assert standby.popen.returncode == -signal.SIGKILL and not psutil.pid_exists(standby.pid)  # killed, reaped


@pytest.mark.parametrize("stopped", [2, 1])
def test_a_restart_never_goes_to_stopped_standbys(tmp_path, stopped):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = start(tmp_path, args=("--nproc", "2", "--max-restarts", "1", "--restart-backoff", "0.2",
                                 "--grace-period", "2"), script=script)
    try:
        assert wait_for(lambda: len(_standbys(proc.pid)) == 2, timeout=90), "no restart standbys started"
        standbys = _standbys(proc.pid)
        for standby in standbys[:stopped]:
            standby.send_signal(signal.SIGSTOP)
        assert wait_for(lambda: all(s.status() == psutil.STATUS_STOPPED for s in standbys[:stopped]), timeout=10)
        [rank1] = [p for p, env in _children(proc.pid) if env.get("RANK") == "1" and contract.STANDBY not in env]
        rank1.send_signal(signal.SIGKILL)
        # generous: a fresh start imports torch; before the fix, two stopped standbys held the
        # restart for the 300 s startup allowance, one cost the last restart (exit 124)
        code, out, err = finish(proc, timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 0, err[-3000:]
    for rank in (0, 1):
        assert f"CPU{rank}:restart 1 rank {rank} done" in out + err
    said = [line for line in err.splitlines() if "restart standby of local rank" in line]
    assert len(said) == stopped and all("process stopped (state T); killed" in line for line in said)
    assert "after 1 restart(s)" in err  # the stopped standby cost no restart of its own
    assert not any(psutil.pid_exists(s.pid) for s in standbys)  # killed and reaped: no orphan
