"""Whose process an NVML pid is: one of ours, another process, or unknown.

NVML reports pids as the host sees them. Inside a container (its own pid
namespace) those are not the pids we know our workers by, and a number that
happens to exist in the container may be an unrelated process. So:

- each of our pids is also matched by the other numbers it has in outer pid
  namespaces (`NSpid:` in /proc/<pid>/status, the outermost one this /proc shows first);
- a pid that matches none of ours is "another process" only where we run in the
  host's pid namespace; in a container it is "unknown owner": it may be another
  container's, or ours under a host pid this /proc cannot show.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# PROC_PID_INIT_INO: the inode of the initial (host) pid namespace, fixed in the kernel.
HOST_PID_NAMESPACE = "pid:[4026531836]"

OURS, FOREIGN, UNKNOWN = "ours", "foreign", "unknown"


@dataclass(frozen=True)
class PidView:
    proc: Path = Path("/proc")

    def in_host_namespace(self) -> bool | None:
        """True/False, or None when /proc does not say (hardened kernels)."""
        try:
            return os.readlink(self.proc / "self" / "ns" / "pid") == HOST_PID_NAMESPACE
        except OSError:
            return None

    def aliases(self, pid: int) -> set[int]:
        """`pid` and every number it has in the pid namespaces this /proc can see."""
        try:
            status = (self.proc / str(pid) / "status").read_text()
        except OSError:
            return {pid}
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                return {pid, *(int(n) for n in line.split()[1:])}
        return {pid}

    def owners(self, nvml_pids: list[int], ours: dict[int, int]) -> dict[int, tuple[str, int | None]]:
        """{nvml pid: (OURS, our pid) | (FOREIGN, None) | (UNKNOWN, None)}; `ours` maps our pid -> rank
        (or any value), only its keys are read."""
        by_alias = {alias: pid for pid in ours for alias in self.aliases(pid)}
        host = self.in_host_namespace()
        out = {}
        for nvml_pid in nvml_pids:
            if nvml_pid in by_alias:
                out[nvml_pid] = (OURS, by_alias[nvml_pid])
            else:
                out[nvml_pid] = (FOREIGN if host else UNKNOWN, None)
        return out


VIEW = PidView()  # this machine's; tests point it at a fake /proc
