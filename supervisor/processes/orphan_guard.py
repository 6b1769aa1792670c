"""Supervisor side of orphan cleanup: the guard process that outlives a killed
supervisor (`orphan_guard_main`), and the sweep of whatever is left below us.

PR_SET_PDEATHSIG takes the workers down with the supervisor; the guard covers what
they forked, which does not inherit it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil


class OrphanGuard:
    """Supervisor side: start the guard, tell it each worker's group, release it at the end."""

    def __init__(self, marker: str, python: str, env: dict[str, str]) -> None:
        # by path, isolated, without site: the guard needs only the standard library, and a guard
        # still importing gpuherd's packages (a second on a loaded machine) would sweep that much later
        self._proc = subprocess.Popen(
            [python, "-I", "-S", str(Path(__file__).with_name("orphan_guard_main.py")), marker],
            stdin=subprocess.PIPE, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pgid: int) -> None:
        self._send(f"pgid {pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"forget {pgid}\n")

    def release(self) -> None:
        """The supervisor cleaned up itself; the guard exits without touching anything."""
        self._send("done\n")
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()

    def _send(self, text: str) -> None:
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except OSError:
            pass


# multiprocessing's own helpers, started by the dataset build's tokenizer pool
_MULTIPROCESSING_HELPERS = ("from multiprocessing.resource_tracker import main",
                            "from multiprocessing.forkserver import main")


def sweep_children(exclude: set[int]) -> None:
    """Anything still below us now (a grandchild that escaped its process group and was
    reparented to us as subreaper) is killed and reaped; multiprocessing's resource tracker
    and forkserver are left to end with us (EOF on their pipe; the guard kills them if we
    die): killed earlier, multiprocessing relaunches the tracker and prints tracebacks the
    next time it releases a semaphore."""
    helpers = _multiprocessing_helpers()
    procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in exclude | helpers]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=2)


def _multiprocessing_helpers() -> set[int]:
    found = set()
    for child in psutil.Process().children():
        try:
            if any(marker in " ".join(child.cmdline()) for marker in _MULTIPROCESSING_HELPERS):
                found.add(child.pid)
        except psutil.Error:
            continue
    return found
