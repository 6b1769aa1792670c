"""A cgroup of the run's own, where one can be had: every process the supervisor starts,
and everything they start, is in it whatever it does (a new session, a cleared environment,
a double fork), so the orphan guard can kill every last one (orphan_guard_main.py).

A cgroup v2 hierarchy must be mounted and writable here (root, or a delegated subtree); the
run's cgroup is `gpuherd-<pid>` below the supervisor's own. Without one (or with
`GPUHERD_CGROUP=0`) the guard falls back on recording the supervisor's process tree as it forms.
"""

from __future__ import annotations

import os
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


def leave_run_cgroup(group: Path) -> bool:
    """At the run's end, every process it started reaped: move this process back to the cgroup
    it came from and remove the run's. False (left to the orphan guard, which removes it once we
    exited) when something is still in it or the move is refused."""
    try:
        (group.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
        group.rmdir()
    except FileNotFoundError:
        return True
    except OSError as exc:
        logger.debug(f"the run's cgroup {group} stays for the orphan guard to remove ({exc})")
        return False
    return True


def remove_stale_run_cgroups(parent: Path) -> list[Path]:
    """Earlier runs' cgroups whose supervisor is gone and that hold no process: a run whose
    whole process tree was SIGKILLed at once (its orphan guard with it) leaves its cgroup
    behind, and nothing else would ever remove it. An empty cgroup is removed with `rmdir`,
    which the kernel refuses while anything is in it: a live run's is never touched."""
    removed = []
    for group in parent.glob("gpuherd-*"):
        pid = group.name.removeprefix("gpuherd-")
        if not pid.isdigit() or int(pid) == os.getpid() or Path(f"/proc/{pid}").exists():
            continue
        try:
            group.rmdir()
        except OSError:
            continue  # still holds a process, or not ours to remove
        removed.append(group)
    if removed:
        logger.debug(f"removed {len(removed)} cgroup(s) of earlier runs that ended without removing them")
    return removed
