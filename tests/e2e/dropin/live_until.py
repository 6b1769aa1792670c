"""examples/live_ddp.py (a plain DDP loop recovered live through gpuherd.live) run until the test
says where to stop: once the file named by --stop-file holds a step, every rank leaves the loop
there. The test writes a step well ahead of the ranks (they are within one step of each other:
every step all-reduces), so a run lasts as long as the test needs it to, whatever the host's
load, and still ends with exit 0.

    live_until.py STOP_FILE EXAMPLE_ARGS...
"""

import runpy
import sys
from pathlib import Path

import gpuherd.live as live

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "live_ddp.py"


def stop_at(path: str) -> int | None:
    try:
        return int(Path(path).read_text(encoding="utf-8").strip() or "x")
    except (OSError, ValueError):
        return None


def until(path: str, attach):
    """`live.attach`, whose session's steps end at the step the file names."""

    def attach_until(*args, **kwargs):
        session = attach(*args, **kwargs)
        steps = session.steps

        def steps_until(numbers):
            for step in steps(numbers):
                stop = stop_at(path)
                if stop is not None and step >= stop:
                    return
                yield step
        session.steps = steps_until
        return session
    return attach_until


if __name__ == "__main__":
    stop_file, sys.argv = sys.argv[1], [str(EXAMPLE), *sys.argv[2:]]
    live.attach = until(stop_file, live.attach)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
