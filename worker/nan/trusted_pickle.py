"""Reading a NaN debug pickle without trusting it.

A pickle can name any importable callable and have it called while it loads
(`os.system`, `builtins.exec`, ...): `pickle.load` on a file someone else planted
in `.checkpoints/debug/` runs their code. gpuherd's own readers (`nan report`,
`nan replay`) therefore load dumps with an unpickler that resolves only what a dump
is made of: dicts, lists, tuples, numbers, strings, bytes, None, booleans (pickle
opcodes, no lookup), numpy arrays, numpy scalars and dtypes (the few numpy
functions below, which only rebuild arrays from bytes). Anything else is refused by
name before it is imported, let alone called: the same trust rule as checkpoints,
which load with `torch.load(weights_only=True)`.

The dump itself stays a plain pickle: a user's own `pickle.load` (seed 003's
snippet) reads it unchanged.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode

# (module, name) pairs numpy's own pickles of arrays, scalars and dtypes refer to, for
# numpy 1.x (`numpy.core`) and 2.x (`numpy._core`); each only rebuilds data from bytes.
_NUMPY_ALLOWED = frozenset(
    (module, name)
    for core in ("numpy.core", "numpy._core")
    for module, name in (
        (f"{core}.multiarray", "_reconstruct"),  # ndarray.__reduce__ (protocol < 5)
        (f"{core}.numeric", "_frombuffer"),  # ndarray.__reduce_ex__ (protocol 5, out-of-band capable)
        (f"{core}.multiarray", "scalar"),  # numpy scalars (np.float32(1.5))
    )
) | {("numpy", "ndarray"), ("numpy", "dtype")}


class UntrustedPickle(GpuherdError):
    """A file that is not a plain NaN dump: it asks for something a dump never holds (exit 2)."""

    exit_code = ExitCode.USAGE


class _PlainDataUnpickler(pickle.Unpickler):
    def __init__(self, handle: io.BufferedIOBase, path: Path) -> None:
        super().__init__(handle)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_ALLOWED:
            return super().find_class(module, name)
        raise UntrustedPickle(
            f"{self._path} is not a plain NaN dump: it asks to load {module}.{name}, which gpuherd never loads "
            "from a pickle (only dicts, lists, numbers, strings and numpy arrays); if you trust where it came "
            "from, read it yourself with pickle.load")

    def persistent_load(self, pid: Any) -> Any:
        raise UntrustedPickle(f"{self._path} is not a plain NaN dump: it refers to persistent objects")


def load_plain(path: Path) -> Any:
    """The pickle at `path`, built from plain data only; UntrustedPickle names what else it asked for.
    Other failures (a truncated or garbled file) raise what pickle raises."""
    path = Path(path)
    with path.open("rb") as handle:
        return _PlainDataUnpickler(handle, path).load()
