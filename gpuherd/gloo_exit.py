"""Before the interpreter finalizes: let gloo's worker threads release what needs the GIL.

Why: a gloo collective's work object holds tensors, and the Python context torch stashes
in its thread-local state during every backward; releasing either takes the GIL. gloo's
worker thread (`pt_gloo_runloop`) drops the work just after completing it, a moment after
the caller went on. When that moment falls in the last few milliseconds before the
interpreter finalizes (a loaded machine schedules the thread late), the thread is still
waiting for the GIL when finalization begins, and CPython (before 3.14) ends a thread that
waits for the GIL then with pthread_exit. Its unwinding through the work's noexcept
destructor is std::terminate: "terminate called without an active exception", SIGABRT,
exit 134, after a run that finished. torch checks Py_IsInitialized, not "finalizing",
before it takes the GIL (pytorch issue 190489); the same script under torchrun aborts the
same way, only as rarely.

`settle()` is the bootstrap's last atexit callback (worker/script_bootstrap.py): it sleeps
in short slices, the GIL free for the taking, until each such thread sat still for a whole
slice (not runnable, no context switch): whatever it still had to release, it released
while the interpreter could still hand it the GIL. It never waits past `limit_s`.
Linux only (/proc), like the supervisor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SETTLING = ("pt_gloo_runloop",)  # ProcessGroupGloo's worker threads, as torch names them
SLICE_S = 0.01  # two GIL switch intervals (5 ms): a thread waiting for the GIL gets it in one
LIMIT_S = 5.0  # a thread still busy this long after the script ended is left to it
TASKS = Path("/proc/self/task")


@dataclass(frozen=True)
class Seen:
    runnable: bool
    switches: tuple[int, int]  # voluntary, involuntary: any run in between changes one


def _look(names: tuple[str, ...], tasks: Path) -> dict[str, Seen]:
    seen = {}
    try:
        threads = list(tasks.iterdir())
    except OSError:  # no /proc: nothing to wait for
        return seen
    for task in threads:
        try:
            if (task / "comm").read_text().strip() not in names:
                continue
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        seen[task.name] = Seen(status["State"].split()[0] == "R",
                               (int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"])))
    return seen


def settle(names: tuple[str, ...] = SETTLING, limit_s: float = LIMIT_S, slice_s: float = SLICE_S,
           tasks: Path = TASKS, clock: Callable[[], float] = time.monotonic) -> bool:
    """True once every thread named in `names` (its /proc comm) sat still through a slice in
    which this thread held no GIL (at once when there is none); False after `limit_s`."""
    deadline = clock() + limit_s
    before = _look(names, tasks)
    while before:
        time.sleep(slice_s)  # releases the GIL: a thread waiting for it takes it now
        after = _look(names, tasks)
        if all(not seen.runnable and before.get(tid) == seen for tid, seen in after.items()):
            return True
        if clock() >= deadline:
            return False
        before = after
    return True
