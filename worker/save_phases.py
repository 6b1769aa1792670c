"""Named points of a checkpoint save, where a test (or someone reproducing a crash) can
freeze the save to kill the run exactly there.

`GPUHERD_PAUSE_SAVE_AT=<phase>[:<step>[:<seconds>|<file>]]` makes the process that reaches
`<phase>` (of the save of `<step>`, or of any save) print `checkpoint save paused at <phase>
(step N) [..., pid P]` on stderr (P: the process writing it, the loop's or its writer's) and
sleep until it is killed, or for `<seconds>` then go on (a slow disk), or until `<file>`
exists then go on (a slow disk that a test ends once it has seen what it waits for, rather
than racing a fixed sleep on a loaded machine). Phases, in order:

- `staging`: the loop is copying the state to host memory (the loop is blocked);
- `staged`: the writer has the copy, nothing is written yet;
- `written`: the temp file (or directory) is complete and fsynced, no manifest yet;
- `manifest`: the manifest is written, the checkpoint not yet renamed into place;
- `published`: renamed into place, not yet reported to the supervisor nor pruned.

Unset (always, outside tests) every call is one dictionary lookup.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PAUSE_VAR = "GPUHERD_PAUSE_SAVE_AT"
PHASES = ("staging", "staged", "written", "manifest", "published")


def reached(phase: str, step: int | None) -> None:
    want = os.environ.get(PAUSE_VAR)
    if not want:
        return
    name, at_step, seconds = (want.split(":") + ["", ""])[:3]
    if name != phase or (at_step and str(step) != at_step):
        return
    sys.stderr.write(f"checkpoint save paused at {phase} (step {step}) [{PAUSE_VAR}, pid {os.getpid()}]\n")
    sys.stderr.flush()
    if seconds:
        try:
            time.sleep(float(seconds))
        except ValueError:
            release = Path(seconds)
            while not release.exists():
                time.sleep(0.05)
        return
    while True:
        time.sleep(3600)
