"""The orphan guard's own process: a tiny program that outlives a killed supervisor
just long enough to clean up (started by `supervisor.processes.orphan_guard.OrphanGuard`).

PR_SET_PDEATHSIG kills the workers when the supervisor dies, even by SIGKILL, but
what the workers forked (data loaders, shells, `sleep`) does not inherit it. The
guard runs in its own session, reads the workers' process-group ids from a pipe
whose only writer is the supervisor, and when that pipe hits EOF without the
supervisor's "done" (it died), SIGKILLs those groups and every process still
carrying this run's marker in its environment.

    python -I -S supervisor/processes/orphan_guard_main.py MARKER   (stdin: "pgid N" / "forget N" lines, then "done")
"""

from __future__ import annotations

import os
import signal
import sys


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


def sweep(pgids: list[int], marker: bytes) -> None:
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
    pgids: list[int] = []
    for raw in sys.stdin.buffer:
        line = raw.strip()
        if line == b"done":
            return 0
        if line.startswith(b"pgid "):
            pgids.append(int(line.split()[1]))
        elif line.startswith(b"forget "):  # that group is gone (an attempt ended): its id may be reused
            pgid = int(line.split()[1])
            if pgid in pgids:
                pgids.remove(pgid)
    sweep(pgids, marker)  # EOF without "done": the supervisor died
    return 0



if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
