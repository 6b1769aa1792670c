"""The launchers the side-by-side benchmarks compare, on the same worker script.

`Launchers` builds gpuherd's, torchrun's and NVIDIA's ft_launcher's command lines
with the same worker count and the same SIGTERM -> SIGKILL grace period (gpuherd
`--grace-period`, torchrun `--shutdown-timeout`, ft_launcher `--term-timeout`); `flags`
go to the launcher, `args` to the script. `exit_after` waits for a launcher with a cap and kills
whatever it left running when the cap is reached.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
FT_LAUNCHER = str(Path(sys.executable).with_name("ft_launcher"))  # pip install nvidia-resiliency-ext


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


class Launchers:
    def __init__(self, work: Path, script: Path, grace_period: float = 5) -> None:
        self.work = work
        self.script = script
        self.grace = grace_period

    def gpuherd(self, n: int, *args: str, flags: tuple[str, ...] = (), report: bool = False) -> list[str]:
        """gpuherd's default settings; `report`: `--report`, the report.html rendered before the
        exit (matplotlib, about a second after the last worker is gone; by default it is not on
        the exit path: `gpuherd report RUN` renders it later)."""
        return [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--set",
                f"system.run_root={self.work / 'logs'}", "--nproc", str(n), "--grace-period", f"{self.grace:g}",
                *(("--report",) if report else ()), *flags, "--script", str(self.script), *args]

    def torchrun(self, n: int, *args: str, flags: tuple[str, ...] = ()) -> list[str]:
        # --tee 3 --log-dir: prefixed lines on the console and one file per worker, like gpuherd
        return [TORCHRUN, "--nproc-per-node", str(n), "--shutdown-timeout", str(round(self.grace)),
                "--tee", "3", "--log-dir", str(self.work / "tlogs"), *flags, str(self.script), *args]

    def ft_launcher(self, n: int, *args: str, flags: tuple[str, ...] = ()) -> list[str]:
        # torchrun's options plus NVIDIA's rank monitors; no NIC to watch on a CPU machine
        return [FT_LAUNCHER, "--nproc-per-node", str(n), "--term-timeout", str(round(self.grace)),
                "--ft-enable-nic-monitor", "false", *flags, str(self.script), *args]


def tree_pids(pid: int) -> list[int]:
    """`pid` and every process below it (gathered before any is killed)."""
    try:
        return [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return [pid]


def tree_processes(pid: int) -> dict[int, float]:
    """Every process below `pid`, pid -> its start time (so a reused pid is not taken for it)."""
    found = {}
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return found
    for child in children:
        try:
            found[child.pid] = child.create_time()
        except psutil.Error:
            continue
    return found


def still_there(processes: dict[int, float]) -> list[int]:
    """Those of `processes` (tree_processes) still present: running, or exited and not reaped."""
    left = []
    for pid, started in processes.items():
        try:
            if psutil.Process(pid).create_time() == started:
                left.append(pid)
        except psutil.Error:
            continue
    return left


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process below it. torchrun starts its workers in
    sessions of their own, so this goes by pid, not by process group."""
    for pid in tree_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def exit_after(proc: subprocess.Popen, since: float, cap: float) -> float:
    """Seconds from `since` (a time.time()) until `proc` exits; `cap` if it is still
    running by then, after killing its whole tree (the figure is a lower bound).

    The exit is seen the moment it happens (a pidfd turns readable): `Popen.wait(timeout)`
    polls with sleeps growing to 50 ms, which put up to 50 ms on every figure (gpuherd's
    teardown read 68, 118, 168 or 218 ms, nothing in between)."""
    fd = os.pidfd_open(proc.pid)
    try:
        exited = select.select([fd], [], [], max(0.0, since + cap - time.time()))[0]
        at = time.time()
    finally:
        os.close(fd)
    if not exited:
        kill_tree(proc)
        return cap
    proc.wait()
    return at - since


def wait_quiet(proc: subprocess.Popen, window: float = 0.2, limit: float = 20.0) -> float:
    """Wait until the launcher's whole process tree used (almost) no CPU for `window` seconds:
    what is still starting (a helper's torch import) is done, as it is when a real training
    is interrupted. Returns the seconds waited (at most `limit`)."""
    t0 = time.monotonic()

    def cpu() -> float:
        total = 0.0
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            return total
        for p in tree:
            try:
                times = p.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    last = cpu()
    while time.monotonic() - t0 < limit:
        time.sleep(window)
        now = cpu()
        if now - last < 0.02 * window:  # under 2% of one core: sleeping ranks, an idle launcher
            break
        last = now
    return time.monotonic() - t0


def run_records(path: Path) -> list[dict]:
    """Every record of a run's metrics.jsonl so far (a line being written is skipped)."""
    import orjson

    out = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue
    return out
