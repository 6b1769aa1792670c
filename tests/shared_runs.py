"""A run made once per test session and read by every test that needs it, whichever
pytest-xdist worker asks first: the others wait for it under a file lock and read the same
directory (with `--dist loadfile` the tests that share a reference run often land on
different workers, and each would otherwise make its own)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def once_per_session(tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """`make(cwd)` runs in a fresh `cwd` the first time `name` is asked for in this session and
    returns the run's directory; every later call, in any worker, returns that directory."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # every worker's common parent
    cwd = shared / f"shared-run-{name}" / "w"  # room beside it for what the run keeps apart (a dataset cache)
    cwd.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / f"shared-run-{name}.lock")):
        done = cwd.parent / "done"
        if not done.exists():
            shutil.rmtree(cwd, ignore_errors=True)  # a worker that failed half-way left it
            cwd.mkdir()
            done.write_text(str(make(cwd).relative_to(cwd)))
        return cwd / done.read_text()
