"""`gpuherd COMMAND [ARGS]`: the installed command (pyproject.toml's console script).

Each command is one line of COMMANDS: its name (one or two words) and the function that
runs it, `module:function(argv) -> exit code`, imported only when that command runs (so
`gpuherd --help` never imports torch). Adding a command is adding a line.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

from gpuherd import __version__
from gpuherd.cli import die
from gpuherd.extras import extras_named


@dataclass(frozen=True)
class Command:
    target: str  # "package.module:function"; function(argv: list[str]) -> int
    summary: str

    def load(self) -> Callable[[list[str]], int]:
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


COMMANDS: dict[str, Command] = {
    "run": Command("supervisor.main:cli", "train: the built-in model (--debug), or your script as torchrun would "
                                           "(gpuherd run [flags] train.py [args])"),
    "gpu": Command("supervisor.commands.gpu:gpu", "one supervised worker on GPU N (= train_gpu.sh N)"),
    "auto": Command("supervisor.commands.gpu:auto", "claim the least-used GPU and train on it (= train_auto_gpu.sh)"),
    "prepare": Command("dataset_cache.cli:main", "build, verify, list or clean the dataset cache "
                                                 "(= prepare_dataset.py)"),
    "generate": Command("worker.generate:main", "sample text from a checkpoint (= generate.py)"),
    "sbatch": Command("supervisor.commands.sbatch:main", "write an sbatch script for a multi-node SLURM job"),
    "topology": Command("supervisor.commands.topology:main", "the GPU link matrix, with warnings for slow pairs"),
    "nan report": Command("worker.nan.report:main", "print a NaN debug dump (nan_debug_step_N.pkl) again"),
    "nan replay": Command("worker.nan.replay:main", "re-run a recorded suspicious step from its checkpoint or pickle "
                                                    "on any device: does it reproduce?"),
    "check": Command("supervisor.commands.check:main", "pre-flight GPU and host checks: a PASS/WARN/FAIL table"),
    "top": Command("supervisor.commands.top:main", "a live table of a run, one row per rank (--once: one frame)"),
    "report": Command("supervisor.commands.report:main", "report.html + PNG figures of a run, or of runs compared"),
    "spare": Command("supervisor.commands.spare:main", "start a warm spare for a running, shrunk run: the group "
                                                       "grows back once it is warm"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: gpuherd COMMAND [ARGS]   (gpuherd COMMAND --help for its options; gpuherd {__version__})",
             "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join(lines)


def find(argv: list[str]) -> tuple[Command, list[str]]:
    """The command the first word or two name, and the rest of the arguments."""
    for words in (2, 1):
        name = " ".join(argv[:words])
        if len(argv) >= words and name in COMMANDS:
            return COMMANDS[name], argv[words:]
    near = [name for name in COMMANDS if name.split()[0] == argv[0]]
    hint = f"did you mean {' or '.join(repr(n) for n in near)}?" if near else f"commands: {', '.join(COMMANDS)}"
    die(f"unknown command {argv[0]!r} ({hint}; see gpuherd --help)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        die(f"give a command: {', '.join(COMMANDS)} (see gpuherd --help)")
    if argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"gpuherd {__version__}")
        return 0
    command, rest = find(argv)
    with extras_named(f"gpuherd {' '.join(argv[:len(argv) - len(rest)])}"):
        return int(command.load()(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
