"""A user's program in place of the built-in trainer, and the command line each rank runs.

    gpuherd run train.py ARGS      python -u BOOTSTRAP train.py ARGS      (torchrun: python -u train.py ARGS)
    gpuherd run -m pkg.train ARGS  python -u BOOTSTRAP -m pkg.train ARGS  (torchrun: python -u -m pkg.train ARGS)
    gpuherd run --no-python prog   prog ARGS, as torchrun runs it

BOOTSTRAP (worker/script_bootstrap.py, started by path) runs the script exactly as Python
would and adds heartbeats from torch's optimizer steps; `--no-auto-heartbeat` leaves it out
and starts the script the way torchrun does. The interpreter is torchrun's choice too:
`PYTHON_EXEC` if set, else the one running gpuherd.
"""

from __future__ import annotations

import os
import shutil
import sys
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

    def check(self) -> None:
        """Before anything is written: a script that is not there, or flags that contradict."""
        if self.module and self.no_python:
            raise ScriptError("-m and --no-python cannot be combined (a module needs python)")
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

    def command(self) -> list[str]:
        if self.no_python:
            return [self.target, *self.args]
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        target = ["-m", self.target] if self.module else [self.target]
        if self.bootstrapped:
            return [python, "-u", str(BOOTSTRAP), *target, *self.args]
        return [python, "-u", *target, *self.args]
