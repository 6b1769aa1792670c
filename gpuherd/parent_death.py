"""A process that must not outlive the one that started it, whatever kills that one.

PR_SET_PDEATHSIG(SIGKILL): the kernel kills this process when the *thread* that forked it
exits, even by SIGKILL, which no cleanup of the parent's can promise. Used by the
supervisor's workers and helpers (set between fork and exec), the dataset build's tokenizer
processes and the checkpoint writer a rank forks. Linux only: elsewhere nothing is set, and
the callers' other cleanups (process groups, the orphan guard) must do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37


def _load_prctl():
    """glibc by its soname; find_library (which runs `ldconfig -p`, a process) only where that
    name is not there (musl). None where there is no prctl at all."""
    for name in ("libc.so.6", None):
        try:
            lib = ctypes.CDLL(name if name else ctypes.util.find_library("c"), use_errno=True)
            prctl = lib.prctl
        except (OSError, AttributeError, TypeError):
            continue
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        return prctl
    return None


_prctl = _load_prctl()  # resolved now: a forked child must not load or look anything up


def die_with_parent(parent_pid: int | None) -> None:
    """From now on SIGKILL reaches this process when its parent ends. `parent_pid`: the parent
    it must have; one that died before this took effect makes it exit now (0/None: unchecked,
    e.g. started by a forkserver). Safe between fork and exec: no imports, no locks."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(128 + signal.SIGKILL)


def become_subreaper() -> bool:
    """Orphaned grandchildren (double-forked, setsid) are reparented to this process, not to init."""
    return _prctl is not None and _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def is_subreaper() -> bool:
    """This process is a child subreaper (`become_subreaper` took effect)."""
    if _prctl is None:
        return False
    flag = ctypes.c_int(0)
    return _prctl(PR_GET_CHILD_SUBREAPER, ctypes.addressof(flag), 0, 0, 0) == 0 and flag.value == 1
