"""Running the real supervisor on the scenario worker (tests/supervisor/workers/scenario.py)."""

from __future__ import annotations

import contextlib

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import orjson
import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIO = REPO_ROOT / "tests" / "supervisor" / "workers" / "scenario.py"
ALLREDUCE = REPO_ROOT / "tests" / "supervisor" / "workers" / "allreduce.py"
COLLECTIVE = REPO_ROOT / "tests" / "supervisor" / "workers" / "collective.py"
# ~53T parameters (600 TB a checkpoint): no disk or RAM anywhere holds it, so a test that
# needs the machine checks to fail does not depend on this machine's free disk or memory
HUGE_MODEL = ("--set", "model.n_layers=1024", "--set", "model.dim=65536", "--set", "model.n_heads=512",
              "--set", "model.n_kv_heads=512")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["GPUHERD_PYTHON"] = sys.executable
    e.pop("CUDA_VISIBLE_DEVICES", None)
    return e


def command(*args: str, behaviours: tuple[str, ...] = (), script: Path | None = SCENARIO) -> list[str]:
    cmd = ["bash", str(REPO_ROOT / "run_training.sh"), "--set", "system.device=cpu", "--no-report", *args]
    if script is not None:
        cmd += ["--script", str(script), *behaviours]
    return cmd


@dataclass
class Result:
    code: int
    out: str
    err: str
    run_dir: Path | None

    @property
    def summary(self) -> dict:
        return orjson.loads((self.run_dir / "summary.json").read_bytes())

    def log(self, rank: int) -> str:
        return next(self.run_dir.glob(f"worker-rank{rank}-*.log")).read_text()


def run_dir_of(cwd: Path) -> Path | None:
    runs = sorted((cwd / "logs").glob("*")) if (cwd / "logs").is_dir() else []
    return runs[-1] if runs else None


def run(cwd: Path, *behaviours: str, args: tuple[str, ...] = (), timeout: float = 60,
        script: Path = SCENARIO) -> Result:
    proc = subprocess.run(command(*args, behaviours=behaviours, script=script), cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr, run_dir_of(cwd))


def start(cwd: Path, *behaviours: str, args: tuple[str, ...] = (), script: Path | None = SCENARIO) -> subprocess.Popen:
    """The supervisor itself (not bash), so tests can signal it directly."""
    cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", *args]
    if script is not None:
        cmd += ["--script", str(script), *behaviours]
    return subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def workers_started(proc: subprocess.Popen, n: int, cwd: Path, lines: int = 2) -> bool:
    """Every worker has logged at least `lines` lines (its status pipe is live by then)."""
    run_dir = run_dir_of(cwd)
    if run_dir is None:
        return False
    logs = list(run_dir.glob("worker-rank*.log"))
    return len(logs) == n and all(len(p.read_text().splitlines()) >= lines for p in logs)


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def worker_of(supervisor_pid: int, rank: int) -> psutil.Process | None:
    """The built-in worker (`python -m worker`) of `rank` among the supervisor's children."""
    for p in psutil.Process(supervisor_pid).children():
        try:
            if "worker" in p.cmdline() and p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    return None


def marked_processes(supervisor_pid: int) -> list[int]:
    """Every process whose environment says it belongs to this supervisor (escapees included)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("GPUHERD_SUPERVISOR_PID") == str(supervisor_pid):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def stop_when(proc: subprocess.Popen, ready, find) -> tuple[int, str, float]:
    """SIGSTOP the worker `find()` returns once `ready()` holds, then wait for the supervisor:
    (its exit code, its stderr, when the worker was stopped). Nothing is left running."""
    try:
        assert wait_for(ready, timeout=120)
        worker = find()
        stopped_at = time.time()
        worker.send_signal(signal.SIGSTOP)
        code, _, err = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return code, err, stopped_at


def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate()
        raise
    return proc.returncode, out, err


@contextlib.contextmanager
def none_left(procs: list[subprocess.Popen]):
    """Whatever the test's end, every process of `procs` still running is killed and reaped."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
