"""This checkout's bytecode for the suite's processes, written once per session.

Where PYTHONDONTWRITEBYTECODE is set (every shell of the development machines here does) no
process writes bytecode, so each of the thousands of processes the suite starts (supervisors,
their rendezvous stores, workers, helpers) compiled every module of ours it imported from
source, again: 0.2-0.5 CPU s
of a supervisor test with scenario workers (up to a third of its cost), about as much in a run of
torch workers, where `import torch` dominates (bench/RESULTS.md, "the suite's cost in CPU seconds").
A process still reads bytecode that is there, and checks it against its source's mtime and size:
an edited module is compiled from its source, never run stale (and its bytecode written anew
next session). `__pycache__/` is git-ignored.

Likewise pytest's rewrite of each test module's asserts, half of a collection's CPU, is cached
where bytecode may be written: writing is allowed while the tests are collected, and only then.
"""

from __future__ import annotations

import compileall
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

# Every package of ours a process the tests start imports from this checkout
PACKAGES = ("gpuherd", "supervisor", "worker", "dataset_cache", "tests")


def compile_bytecode(root: Path, packages: tuple[str, ...] = PACKAGES) -> None:
    """Each module's bytecode beside it, written whatever sys.dont_write_bytecode says; a module
    whose bytecode is up to date is left alone (about 1 CPU s the first time, 0.06 after)."""
    for package in packages:
        compileall.compile_dir(root / package, quiet=1)


@contextlib.contextmanager
def writing_bytecode() -> Iterator[None]:
    """Bytecode (pytest's rewritten test modules among it) written inside, the process's own
    setting back after."""
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = before
