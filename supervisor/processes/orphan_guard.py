"""Supervisor side of orphan cleanup: the guard process that outlives a killed
supervisor (`orphan_guard_main`), and the sweep of whatever is left below us.

PR_SET_PDEATHSIG takes the workers down with the supervisor; the guard covers what
they forked, which does not inherit it.
"""

from __future__ import annotations

import subprocess

import psutil


class OrphanGuard:
    """Supervisor side: start the guard, tell it each worker's group, release it at the end."""

    def __init__(self, marker: str, python: str, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [python, "-m", "supervisor.processes.orphan_guard_main", marker], stdin=subprocess.PIPE, env=env,
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


def sweep_children(exclude: set[int]) -> None:
    """Anything still below us now (a grandchild that escaped its process group and was
    reparented to us as subreaper) is killed and reaped."""
    procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in exclude]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=2)
