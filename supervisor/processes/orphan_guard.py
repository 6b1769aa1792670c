"""Supervisor side of orphan cleanup: the guard process that outlives a killed
supervisor (`orphan_guard_main`), and the sweep of whatever is left below us.

PR_SET_PDEATHSIG takes the workers down with the supervisor; the guard covers what
they forked, which does not inherit it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import psutil

GUARD_MAIN = Path(__file__).with_name("orphan_guard_main.py")  # imports os, signal and sys only


class OrphanGuard:
    """Supervisor side: start the guard, tell it each worker's group, release it at the end."""

    def __init__(self, marker: str, python: str, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            # by path, not -m: `-m` imports the supervisor package first (NVML, psutil, ldconfig: seconds
            # of CPU on a busy node), which the launcher then waited out on every exit
            [python, str(GUARD_MAIN), marker], stdin=subprocess.PIPE, env=env,
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
        """The supervisor cleaned up itself; the guard exits on "done" without touching anything.
        Not waited for: it needs nothing more from us, and on a busy node an interpreter's exit
        waits for a time slice (~100 ms at load 18 on 2 cores) the launcher's exit would too."""
        self._send("done\n")
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        self._proc.poll()

    def _send(self, text: str) -> None:
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except OSError:
            pass


def sweep_children(exclude: set[int]) -> None:
    """Anything still below us now (a grandchild that escaped its process group and was
    reparented to us as subreaper) is killed and reaped."""
    procs = []
    for pid in _descendants(os.getpid()):
        if pid not in exclude:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                continue
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=2)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from the kernel's per-thread child lists: a walk of the
    tree itself, where psutil's `children()` reads the stat file of every process on the
    machine (hundreds of milliseconds on a busy node, twice on every exit)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except FileNotFoundError:
                if parent == pid:  # a kernel without CONFIG_PROC_CHILDREN: ask psutil
                    return [p.pid for p in psutil.Process(pid).children(recursive=True)]
                continue
            except OSError:
                continue
            found += children
            todo += children
    return found
