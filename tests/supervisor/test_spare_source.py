"""A script's spares forked by its spare source (worker/spare_fork.py, supervisor/processes/spare_source.py),
with real processes: the bootstrap imports torch once, each spare is a fork of it that is the
supervisor's child, waits at no CPU cost and runs the script with torch already imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import orjson
import psutil

ROOT = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")

SCRIPT = """\
import json, os, sys
print(json.dumps({"torch": "torch" in sys.modules, "rank": os.environ.get("RANK"), "pid": os.getpid(),
                  "source_fd": os.environ.get("GPUHERD_SPARE_SOURCE_FD")}))
"""

# The supervisor's side, in a process of its own (a child subreaper, as gpuherd's supervisor is):
# one source started through spawn() as the pool starts it, two spares asked of it; what it saw, as JSON.
HARNESS = """\
import json, os, socket, sys, time
from pathlib import Path
from gpuherd.parent_death import become_subreaper
from supervisor.gpus import DeviceSlot
from supervisor.processes.spare_source import SpareSource
from supervisor.processes.spawn import spawn

assert become_subreaper() and SpareSource.possible()
os.environ["GPUHERD_SUPERVISOR_PID"] = str(os.getpid())
script, logs = sys.argv[1], Path(sys.argv[2])
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
env = {**os.environ, "GPUHERD_STANDBY": "1", "GPUHERD_SPARE_SOURCE_FD": str(theirs.fileno())}
slot = DeviceSlot(0, "cpu", 0)
process = spawn([sys.executable, "-u", sys.argv[3], script], lambda fd: {**env, "GPUHERD_STATUS_FD": str(fd)}, slot,
                logs / "source.log", stdin_pipe=True, keep_fds=(theirs.fileno(),))
theirs.close()
source = SpareSource(process, ours, lambda pgid: None, logs)
asked = time.monotonic()
assert source.ask(1) and source.ask(2)
spares = []
while len(spares) < 2 and time.monotonic() - asked < 110:
    spares += source.collect(slot)[0]
    time.sleep(0.01)
first_at = time.monotonic()
print(json.dumps({"source": process.pid, "spares": [s.pid for s in spares]}), flush=True)
sys.stdin.readline()  # the test measured their CPU use while they waited
refill = time.monotonic()
assert source.ask(3)
while len(spares) < 3 and time.monotonic() - refill < 60:
    spares += source.collect(slot)[0]
    time.sleep(0.001)
refill_s = time.monotonic() - refill
handed = spares[0].hand_over(DeviceSlot(3, "cpu", 3), logs / "rank3.log", {**os.environ, "RANK": "3"},
                             started=time.monotonic())
out = b""
while handed.poll() is None:
    time.sleep(0.01)
out = handed.popen.stdout.read()
print(json.dumps({"ran": json.loads(out), "exit": handed.returncode, "refill_s": refill_s,
                  "left": spares[2].pid}), flush=True)
sys.stdin.readline()
os._exit(0)  # the supervisor dies with spares 2 and 3 still waiting
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_spares_forked_by_the_source_are_the_supervisors_warm_children_that_wait_for_nothing(tmp_path):
    (tmp_path / "show.py").write_text(SCRIPT)
    bootstrap = ROOT / "worker" / "script_bootstrap.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    harness = subprocess.Popen([sys.executable, "-u", "-c", HARNESS, str(tmp_path / "show.py"), str(tmp_path),
                                str(bootstrap)], cwd=tmp_path, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        seen = orjson.loads(harness.stdout.readline())
        spares = seen["spares"]
        assert len(spares) == 2, seen
        for pid in spares:
            proc = psutil.Process(pid)
            assert proc.ppid() == harness.pid  # reparented to the supervisor: its SIGCHLD, its exit status
            assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # a session and a group of its own
        # waiting: the source and both spares blocked on their input, 2 s of no CPU at all (a tick of slack each)
        watched = [seen["source"], *spares]
        before = [_cpu_s(pid) for pid in watched]
        time.sleep(2.0)
        used = [round(_cpu_s(pid) - b, 3) for pid, b in zip(watched, before)]
        assert all(u <= 1 / TICKS for u in used), f"CPU seconds in 2 s of waiting: {used}"
        harness.stdin.write("measured\n")
        harness.stdin.flush()
        after = orjson.loads(harness.stdout.readline())
        # a refill is a fork of the warm source: answered within 5 s on a loaded machine (it took
        # 0.05 s at a load average of 18), against 2-25 s for an interpreter importing torch
        assert after["refill_s"] < 5.0, after
        assert after["exit"] == 0
        assert after["ran"] == {"torch": True, "rank": "3", "pid": spares[0], "source_fd": None}
        harness.stdin.write("die\n")
        harness.stdin.flush()
        assert harness.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in (spares[1], after["left"])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(spares[1]) and _gone(after["left"])  # the supervisor's death is theirs (PR_SET_PDEATHSIG)
    finally:
        harness.kill()
        harness.wait()
        for proc in psutil.Process().children(recursive=True):
            proc.kill()
