"""A copy of a checkpoint's state in host memory, taken while the loop waits, so that
training can go on changing the live tensors while a writer thread saves the copy.

On CUDA the copy lands in pinned memory (the GPU writes into it at full PCIe speed,
non-blocking, then one synchronize); on CPU it is a plain memory copy. The buffers are
kept between saves (torch's DefaultStager caches one per source storage), so only the
first save allocates. torch.distributed.checkpoint's `async_save` stages the same way.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch

from gpuherd.storage import format_bytes

# Staging buffers may take at most this share of the host memory available when training
# starts: past it the copy would push the machine into swap or the OOM killer, and a save
# that blocks is the safer choice.
MAX_SHARE_OF_AVAILABLE = 0.5


def stager_missing() -> str | None:
    """Why this torch cannot stage (None: it can)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.distributed.checkpoint.staging.DefaultStager (torch >= 2.8)"
    return None


def memory_problem(nbytes: int, copies: int = 1) -> str | None:
    """Why `copies` host copies of `nbytes` (the staging buffers, and on a CPU run with a forked
    writer the live state's pages it shares) would not fit this host comfortably (None: they fit)."""
    available = psutil.virtual_memory().available
    if copies * nbytes <= MAX_SHARE_OF_AVAILABLE * available:
        return None
    what = ("a host copy of this rank's checkpoint state takes" if copies == 1 else
            f"{copies} host copies of this rank's checkpoint state (the staged one, and the pages training "
            "rewrites while a forked writer shares them) take")
    return (f"{what} ~{format_bytes(copies * nbytes)}, more than half of the "
            f"{format_bytes(available)} of memory available")


class HostStager:
    """Copies any nested state (dicts, lists, tensors, DTensors, plain values) into its buffers."""

    def __init__(self, device: torch.device) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                 use_non_blocking_copy=cuda)
        self._fresh = lambda: _copying_classes(DefaultStager(options))
        self._stager = self._fresh()

    def copy(self, state: Any) -> Any:
        """A deep copy whose tensors live in host memory; returns once the copy is complete."""
        if _spent(self._stager):
            self._stager = self._fresh()
        return self._stager.stage(state)

    def close(self) -> None:
        self._stager.close()


def _dispatch(stager: object) -> dict | None:
    """The copier table of torch's state-dict stager inside `stager` (None: a torch without one)."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    return table if isinstance(table, dict) else None


def _copying_classes(stager: Any) -> Any:
    """torch's state-dict stager rebuilds a container it has no copier for through
    `__reduce_ex__`, whose arguments hold the container's class, and copies a class with its
    table's entry for `type`; where that entry is missing, the save ends in `KeyError: <class
    'type'>`. A class is copied as itself, as `copy.deepcopy` does."""
    table = _dispatch(stager)
    if table is not None and int in table:
        table.setdefault(type, table[int])  # the table's atomic copier: the object itself
    return stager


def _spent(stager: object) -> bool:
    """torch 2.8-2.12 close their state-dict stager after every stage, which empties its copier
    table (and its buffer cache): the next save then copied every dict through `__reduce_ex__`
    and failed on its class (seen on an H100, torch 2.11, at the second save). Such a stager is
    replaced by a fresh one before each save."""
    table = _dispatch(stager)
    return table is not None and not table
