"""The orphan guard's own process: a tiny program that outlives a killed supervisor
just long enough to clean up (started by `supervisor.processes.orphan_guard.OrphanGuard`).

PR_SET_PDEATHSIG kills the workers when the supervisor dies, even by SIGKILL, but
what the workers forked (data loaders, shells, `sleep`) does not inherit it. The
guard runs in its own session, reads the workers' process-group ids from a pipe
whose only writer is the supervisor, and when that pipe hits EOF without the
supervisor's "done" (it died), SIGKILLs those groups, every process still carrying
this run's marker in its environment, and every descendant the supervisor had:

- with the run's cgroup (supervisor/processes/cgroup.py, named on the pipe), every
  process in it: nothing started below the supervisor can leave it;
- without one, every process it saw below the supervisor (by pid and start time, so a
  reused pid is spared), the tree read every POLL_S while the supervisor lives. A
  descendant that calls setsid(), clears its environment and is started, reparented
  and the supervisor killed all within one poll can still escape: only a cgroup closes that.

    python -I -S supervisor/processes/orphan_guard_main.py MARKER
    (stdin: "cgroup PATH" / "pgid N" / "forget N" / "uncgroup" lines, then "done")
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time


def _marked_pids(marker: bytes) -> list[int]:
    """Processes of ours whose environment carries the run marker (setsid escapees too)."""
    pids = []
    me, uid = os.getpid(), os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


POLL_S = 0.2  # without a cgroup: how often the supervisor's process tree is recorded


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()  # field 22: start time in ticks
    except (OSError, IndexError):
        return None


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _kill_cgroup(group: str) -> None:
    """Every process in the run's cgroup, until none is left (one may fork while we kill)."""
    try:
        with open(os.path.join(group, "cgroup.kill"), "w") as f:  # Linux 5.14+: the kernel does it at once
            f.write("1")
    except OSError:
        pass
    for _ in range(100):
        try:
            with open(os.path.join(group, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split() if int(p) != os.getpid()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _remove_cgroup(group: str) -> None:
    """Once the supervisor has exited (its stdin closes a moment before it does) and, after a
    sweep, every process in it is gone: EBUSY until then, for at most a minute."""
    for _ in range(1200):
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)


def sweep(pgids: list[int], marker: bytes, seen: dict[int, str] | None = None, group: str | None = None) -> None:
    if group is not None:
        _kill_cgroup(group)
    for pid, started in (seen or {}).items():
        if _start_time(pid) == started:  # still the process we saw, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    for pid in _marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    marker = argv[0].encode()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        # a Ctrl-C, hangup or SLURM's signals to every process of a step (scancel, its USR1
        # warning) are aimed at the supervisor: they must not end us first
        signal.signal(sig, signal.SIG_IGN)
    supervisor = int(marker.rsplit(b"=", 1)[1]) if marker.rsplit(b"=", 1)[-1].isdigit() else None
    pgids: list[int] = []
    seen: dict[int, str] = {}  # without a cgroup: every descendant of the supervisor seen -> its start time
    group: str | None = None
    done, pending = False, b""
    stdin = sys.stdin.buffer.fileno()
    while True:
        if group is None and supervisor is not None and not done:
            for pid in _descendants(supervisor):  # the guard is one of them: never its own target
                if pid != os.getpid() and pid not in seen and (started := _start_time(pid)) is not None:
                    seen[pid] = started
        ready, _, _ = select.select([stdin], [], [], POLL_S if group is None and not done else None)
        if not ready:
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:  # EOF: the supervisor exited
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in (raw.strip() for raw in lines):
            if line == b"done":
                done = True  # nothing to kill; stay until the supervisor exits to remove its cgroup
            elif line.startswith(b"cgroup "):
                group = line.split(b" ", 1)[1].decode()
            elif line == b"uncgroup":  # the supervisor removed its cgroup itself (every process reaped)
                group = None
            elif line.startswith(b"pgid "):
                pgids.append(int(line.split()[1]))
            elif line.startswith(b"forget "):  # that group is gone (an attempt ended): its id may be reused
                pgid = int(line.split()[1])
                if pgid in pgids:
                    pgids.remove(pgid)
        if done and group is None:
            return 0
    if not done:
        sweep(pgids, marker, seen, group)  # EOF without "done": the supervisor died
    if group is not None:
        _remove_cgroup(group)
    return 0



if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
