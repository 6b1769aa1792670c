"""A cgroup of the run's own, where one can be had: every process the supervisor starts,
and everything they start, is in it whatever it does (a new session, a cleared environment,
a double fork), so the orphan guard can kill every last one (orphan_guard_main.py).

A cgroup v2 hierarchy must be mounted and writable here (root, or a delegated subtree); the
run's cgroup is `gpuherd-<pid>` below the supervisor's own. Without one (or with
`GPUHERD_CGROUP=0`) the guard falls back on recording the supervisor's process tree as it forms.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from loguru import logger

DISABLE = "GPUHERD_CGROUP"  # "0": no cgroup (the process-tree fallback)


def cgroup2_mount(mounts: str) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified on a hybrid host)."""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def own_cgroup_path(proc_cgroup: str) -> str | None:
    """This process's place in the v2 hierarchy: the `0::PATH` line of /proc/self/cgroup."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def enter_run_cgroup() -> Path | None:
    """Create the run's cgroup and move this process into it (its children to come inherit it).
    None where no writable cgroup v2 is to be had: the guard then tracks the process tree."""
    if os.environ.get(DISABLE) == "0":
        return None
    try:
        mount = cgroup2_mount(Path("/proc/self/mounts").read_text())
        here = own_cgroup_path(Path("/proc/self/cgroup").read_text())
        if mount is None or here is None:
            return None
        parent = mount / here.lstrip("/")
        remove_stale_run_cgroups(parent)
        group = parent / f"gpuherd-{os.getpid()}"
        group.mkdir()
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError as exc:
        logger.debug(f"no cgroup of the run's own ({exc}): the orphan guard records the process tree instead")
        return None
    return group


def step_out_of_run_cgroup(group: Path) -> bool:
    """At the run's end: move this process back to the cgroup it came from (nothing it starts from
    now on is in the run's). The first move in a while waits for an RCU grace period in the kernel
    (about 10 ms here), so the run's end does it while its last helpers are still dying, not after
    them. False when the move is refused."""
    return _done(lambda: (group.parent / "cgroup.procs").write_text(f"{os.getpid()}\n"), group)


def remove_run_cgroup(group: Path) -> bool:
    """Remove the run's cgroup, this process out of it and every process it held reaped; False
    (left to the orphan guard) when something is still in it."""
    return _done(group.rmdir, group)


def _done(action: Callable[[], object], group: Path) -> bool:
    """`action` on the run's cgroup; False when the kernel refuses it (the cgroup then stays for
    the orphan guard to remove once we exited)."""
    try:
        action()
    except FileNotFoundError:
        return True
    except OSError as exc:
        logger.debug(f"the run's cgroup {group} stays for the orphan guard to remove ({exc})")
        return False
    return True


def remove_stale_run_cgroups(parent: Path) -> list[Path]:
    """Earlier runs' cgroups whose supervisor is gone: a run whose supervisor and orphan guard
    were SIGKILLed together (`pkill -9 -f supervisor` matches both) leaves its cgroup behind,
    empty or still holding what outlived them (a `setsid()` grandchild), and nothing else would
    ever end those or remove it. What is left in such a cgroup belongs to a run that is over:
    it is killed through the kernel's `cgroup.kill` (all at once, nothing can escape by
    forking), then the cgroup removed. A live run's cgroup is never touched (its supervisor's
    pid exists); a pid reused by another process keeps a dead run's cgroup for a later start."""
    removed = []
    for group in parent.glob("gpuherd-*"):
        pid = group.name.removeprefix("gpuherd-")
        if not pid.isdigit() or int(pid) == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        if _kill_leftovers(group, pid) and not _rmdir_when_empty(group):
            continue
        try:
            group.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            continue  # still holds a process, or not ours to remove
        removed.append(group)
    if removed:
        logger.debug(f"removed {len(removed)} cgroup(s) of earlier runs that ended without removing them")
    return removed


def _kill_leftovers(group: Path, supervisor_pid: str) -> bool:
    """True when a dead run's cgroup still held processes and they were sent SIGKILL. Only
    through the kernel's own `cgroup.kill` (Linux 5.14+): where it is missing this is not a
    live cgroup v2 directory, or too old a kernel to kill a whole cgroup safely, and nothing is
    killed."""
    kill = group / "cgroup.kill"
    try:
        left = [line for line in (group / "cgroup.procs").read_text().split() if line.isdigit()]
        if not left or not kill.is_file():
            return False
        kill.write_text("1\n")
    except OSError:
        return False
    logger.warning(f"killed {len(left)} process(es) left by an earlier run (supervisor pid {supervisor_pid}, gone) "
                   f"in its cgroup {group}: they outlived it when it was SIGKILLed with its orphan guard")
    return True


def _rmdir_when_empty(group: Path, wait_s: float = 2.0) -> bool:
    """The kill is asynchronous: the cgroup empties once its processes have exited."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            group.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.02)
    return False
