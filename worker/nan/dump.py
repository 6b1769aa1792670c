"""The NaN debug pickle: `{'parameters': {name: ndarray}, 'gradients':
{name: ndarray}, ...}`, written atomically and kept under `debug.max_dump_mb`.

Plain builtins and numpy float32 arrays only, so a plain numpy analysis
(`np.isnan(param).any()` over both dicts) runs on it unchanged and loading it
needs neither torch nor gpuherd.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.files import atomic_file
from worker.nan.names import local_tensor, named_parameters

FORMAT = "gpuherd.nan_debug/1"
FLOAT_BYTES = 4  # tensors are dumped as float32 whatever their training dtype


@dataclass
class DumpSelection:
    parameters: dict[str, np.ndarray] = field(default_factory=dict)
    gradients: dict[str, np.ndarray] = field(default_factory=dict)
    omitted: list[dict[str, Any]] = field(default_factory=list)  # name, kind, mb
    empty_shards: list[str] = field(default_factory=list)
    bytes: int = 0


def select_tensors(model: torch.nn.Module, affected: list[str], limit_bytes: int) -> DumpSelection:
    """Affected layers first (their value and gradient), then the rest in model
    order; whatever does not fit in `limit_bytes` is listed in `omitted`."""
    candidates: list[tuple[str, str, torch.Tensor]] = []
    for name, param in named_parameters(model):
        candidates.append((name, "parameters", param))
        if param.grad is not None:
            candidates.append((name, "gradients", param.grad))
    first = set(affected)
    candidates.sort(key=lambda c: c[0] not in first)  # stable: model order within each group
    picked = DumpSelection()
    for name, kind, tensor in candidates:
        local = local_tensor(tensor.detach())
        if local.numel() == 0:  # an FSDP rank may hold no elements of a small parameter
            if kind == "parameters":
                picked.empty_shards.append(name)
            continue
        size = local.numel() * FLOAT_BYTES
        if picked.bytes + size > limit_bytes:
            picked.omitted.append({"name": name, "kind": kind, "mb": round(size / 2**20, 3)})
            continue
        getattr(picked, kind)[name] = local.float().cpu().numpy()
        picked.bytes += size
    return picked


def omitted_note(selection: DumpSelection, limit_mb: int) -> str | None:
    if not selection.omitted:
        return None
    total = sum(o["mb"] for o in selection.omitted)
    return (f"debug.max_dump_mb={limit_mb}: left out {len(selection.omitted)} tensors ({total:.1f} MiB as float32);"
            " affected layers were kept first; see 'omitted'")


def write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """A plain pickle a reader never sees half written, even after a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as handle:
        pickle.dump(payload, handle, protocol=pickle.HIGHEST_PROTOCOL)


def token_ids(batches: list[Any]) -> list[np.ndarray]:
    """Each micro-batch's input ids: the batch itself, or the inputs of an (inputs, targets) pair."""
    return [(b[0] if isinstance(b, (tuple, list)) else b).detach().cpu().numpy() for b in batches]


def target_ids(batches: list[Any]) -> list[np.ndarray] | None:
    """The targets of (inputs, targets) pairs (an offline replay needs both); None for plain ids."""
    if not batches or not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
        return None
    return [b[1].detach().cpu().numpy() for b in batches]


def load(path: Path) -> dict[str, Any]:
    """A dump for gpuherd's own readers: plain data only (trusted_pickle), never code the file names."""
    data = load_plain(path)
    if not isinstance(data, dict) or "parameters" not in data or "gradients" not in data:
        raise ValueError(f"{path} is not a NaN debug dump (no 'parameters'/'gradients' dict)")
    return data


# ---- reading a dump back without trusting it
# A pickle can name any importable callable and have it called while it loads
# (`os.system`, `builtins.exec`, ...): `pickle.load` on a file someone else planted
# in `.checkpoints/debug/` runs their code. gpuherd's own readers (`nan report`,
# `nan replay`) therefore load dumps with an unpickler that resolves only what a dump
# is made of: dicts, lists, tuples, numbers, strings, bytes, None, booleans (pickle
# opcodes, no lookup), numpy arrays, numpy scalars and dtypes (the few numpy
# functions below, which only rebuild arrays from bytes). Anything else is refused by
# name before it is imported, let alone called: the same trust rule as checkpoints,
# which load with `torch.load(weights_only=True)`.
#
# The dump itself stays a plain pickle: a user's own `pickle.load` (seed 003's
# snippet) reads it unchanged.
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
