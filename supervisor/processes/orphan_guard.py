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

from supervisor.processes.cgroup import enter_run_cgroup, remove_run_cgroup, step_out_of_run_cgroup

GUARD_MAIN = Path(__file__).with_name("orphan_guard_main.py")  # imports os, signal and sys only
REAP_WAIT_S = 5.0  # a released guard exits at once; this only bounds a machine that does not schedule it


class OrphanGuard:
    """Supervisor side: start the guard, tell it each worker's group, release it at the end."""

    def __init__(self, marker: str, python: str, env: dict[str, str]) -> None:
        # by path, isolated, without site: the guard needs only the standard library, and a guard
        # still importing gpuherd's packages (a second on a loaded machine) would sweep that much later
        self._proc = subprocess.Popen(
            # by path, not -m (`-m` imports the supervisor package first: NVML, psutil, ldconfig, seconds
            # of CPU on a busy node, which the launcher then waited out on every exit)
            [python, "-I", "-S", str(GUARD_MAIN), marker], stdin=subprocess.PIPE, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
        )
        # after the guard started (it stays outside): every process started from now on is in it
        self.cgroup = enter_run_cgroup()
        self._out = False  # this process has left the run's cgroup (step_out)
        if self.cgroup is not None:
            self._send(f"cgroup {self.cgroup}\n")

    @property
    def pid(self) -> int:
        return self._proc.pid

    def watch(self, pgid: int) -> None:
        self._send(f"pgid {pgid}\n")

    def forget(self, pgid: int) -> None:
        self._send(f"forget {pgid}\n")

    def release(self) -> None:
        """The supervisor cleaned up itself; the guard is told "done" and touches nothing from
        then on. Not waited for here: its exit (a time slice on a busy node) overlaps the
        summary's writing, and `reap` collects it just before the launcher's own exit."""
        self._send("done\n")
        if self.cgroup is None:
            self._close()
        self._proc.poll()

    def step_out(self) -> bool:
        """Released: this process leaves the run's cgroup (False: the move was refused). Called
        while the last helpers die: the kernel's wait on the move overlaps theirs."""
        if self.cgroup is not None and not self._out:
            self._out = step_out_of_run_cgroup(self.cgroup)
        return self._out

    def reap(self, timeout: float = REAP_WAIT_S) -> None:
        """Released: wait for its exit, so the launcher's exit code comes after it (bounded: a
        guard that does not end is killed). With a cgroup, every process in it is reaped by now
        (the dying store helper included): this process leaves it and removes it, and the guard
        exits; a cgroup that cannot be removed yet the guard removes once we exited, so that
        guard outlives us by design and is not waited for."""
        if self.cgroup is not None:
            removed = self.step_out() and remove_run_cgroup(self.cgroup)
            if removed:
                self._send("uncgroup\n")
            self._close()
            if not removed:
                return
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _close(self) -> None:
        try:
            self._proc.stdin.close()
        except OSError:
            pass

    def _send(self, text: str) -> None:
        try:
            self._proc.stdin.write(text.encode())
            self._proc.stdin.flush()
        except OSError:
            pass


# CONFIG_PROC_CHILDREN: without it the tree is walked by psutil instead
_KERNEL_CHILD_LISTS = Path(f"/proc/self/task/{os.getpid()}/children").exists()

# multiprocessing's own helpers, started by the dataset build's tokenizer pool
_MULTIPROCESSING_HELPERS = ("from multiprocessing.resource_tracker import main",
                            "from multiprocessing.forkserver import main")


def sweep_children(exclude: set[int]) -> None:
    """Anything still below us now (a grandchild that escaped its process group and was
    reparented to us as subreaper) is killed and reaped; multiprocessing's resource tracker
    and forkserver are left to end with us (EOF on their pipe; the guard kills them if we
    die): killed earlier, multiprocessing relaunches the tracker and prints tracebacks the
    next time it releases a semaphore."""
    skip = exclude | _multiprocessing_helpers()
    procs = []
    for pid in _descendants(os.getpid()):
        if pid not in skip:
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


def _multiprocessing_helpers() -> set[int]:
    found = set()
    children = _children(os.getpid()) if _KERNEL_CHILD_LISTS else [p.pid for p in psutil.Process().children()]
    for pid in children:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in _MULTIPROCESSING_HELPERS):
            found.add(pid)
    return found


def _children(pid: int) -> list[int]:
    """`pid`'s children from the kernel's per-thread child lists (a vanished task has none)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    children = []
    for task in tasks:
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, walking the tree itself, where psutil's `children()`
    reads the stat file of every process on the machine (hundreds of milliseconds on a
    busy node, twice on every exit)."""
    if not _KERNEL_CHILD_LISTS:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    found, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        found += children
        todo += children
    return found
