"""A user's program in place of the built-in trainer, and the command line each rank runs.

    gpuherd run train.py ARGS      python -u BOOTSTRAP train.py ARGS      (torchrun: python -u train.py ARGS)
    gpuherd run -m pkg.train ARGS  python -u BOOTSTRAP -m pkg.train ARGS  (torchrun: python -u -m pkg.train ARGS)
    gpuherd run --no-python prog   prog ARGS, as torchrun runs it

`${local_rank}` in the script's path and arguments becomes each rank's local rank (`$$` is
a `$`), as torchrun's `macros.substitute` does (string.Template.safe_substitute).

BOOTSTRAP (worker/script_bootstrap.py, started by path) runs the script exactly as Python
would and adds heartbeats from torch's optimizer steps; `--no-auto-heartbeat` leaves it out
and starts the script the way torchrun does. The interpreter is torchrun's choice too:
`PYTHON_EXEC` if set, else the one running gpuherd (`--run-path`: always that one, as
torchrun runs the script inside its own interpreter then).
"""

from __future__ import annotations

import os
import shutil
import sys
from string import Template
from dataclasses import dataclass, field
from pathlib import Path

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from supervisor import REPO_ROOT

BOOTSTRAP = REPO_ROOT / "worker" / "script_bootstrap.py"


class ScriptError(GpuherdError):
    """A script that cannot be started; one line for the user."""

    exit_code = ExitCode.USAGE


@dataclass
class Script:
    target: str  # the path as typed (sys.argv[0] sees it so), a module with -m, a program with --no-python
    args: list[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    auto_heartbeat: bool = True
    run_path: bool = False  # torchrun --run-path: the launcher's own interpreter, never PYTHON_EXEC

    def check(self, files: bool = True) -> None:
        """Before anything is written: a script that is not there (`files`: looked for on this
        machine), or flags that contradict."""
        if self.module and self.no_python:
            raise ScriptError("-m and --no-python cannot be combined (a module needs python)")
        if self.run_path and (self.module or self.no_python):
            raise ScriptError(f"--run-path runs a script file: it cannot be combined with "
                              f"{'-m' if self.module else '--no-python'}")
        if not files:
            return
        if self.no_python:
            if shutil.which(self.target) is None:
                raise ScriptError(f"--no-python: {self.target} is not an executable program")
        elif not self.module and Path(self.target).is_dir():
            raise ScriptError(f"script {self.target} is a directory, not a script")
        elif not self.module and not Path(self.target).is_file():
            raise ScriptError(f"script not found: {self.target}")

    @property
    def bootstrapped(self) -> bool:
        return self.auto_heartbeat and not self.no_python

    def command(self, local_rank: int | None = None) -> list[str]:
        """The command line of the rank with `local_rank` (None: as typed, for the logs)."""
        if self.no_python:
            return [self.target, *_substitute(self.args, local_rank)]
        python = sys.executable if self.run_path else os.environ.get("PYTHON_EXEC", sys.executable)
        target = ["-m", self.target] if self.module else [self.target]
        rest = _substitute([*target, *self.args], local_rank)
        if self.bootstrapped:
            return [python, "-u", str(BOOTSTRAP), *rest]
        return [python, "-u", *rest]


def _substitute(args: list[str], local_rank: int | None) -> list[str]:
    """torchrun's macros.substitute: `${local_rank}` -> the rank's local rank, `$$` -> `$`."""
    if local_rank is None:
        return list(args)
    return [Template(arg).safe_substitute(local_rank=str(local_rank)) for arg in args]
