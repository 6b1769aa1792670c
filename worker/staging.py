"""A copy of a checkpoint's state in host memory, taken while the loop waits, so that
training can go on changing the live tensors while a writer thread saves the copy.

On CUDA the copy lands in pinned memory (the GPU writes into it at full PCIe speed,
non-blocking, then one synchronize); on CPU it is a plain memory copy. The buffers are
kept between saves (torch's DefaultStager caches one per source storage), so only the
first save allocates. torch.distributed.checkpoint's `async_save` stages the same way.
"""

from __future__ import annotations

import copy
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
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=cuda))

    def copy(self, state: Any) -> Any:
        """A deep copy whose tensors live in host memory; returns once the copy is complete.

        Only the tensors go through torch's stager, all in one call (so views of one storage
        still share one buffer); the rest is copied here. torch 2.8-2.12's stager cannot copy
        a class object (its copier table has no entry for `type`: KeyError at the first save on
        a GPU), and the plain values a state holds need nothing of it anyway."""
        tensors: dict[int, torch.Tensor] = {}
        skeleton = _without_tensors(state, tensors)
        staged = self._stager.stage(tensors) if tensors else {}
        return _with_tensors(skeleton, staged)

    def close(self) -> None:
        self._stager.close()


class _Slot(int):
    """Where a tensor stood in the state (its key in the dict handed to the stager)."""


def _without_tensors(state: Any, tensors: dict[int, torch.Tensor]) -> Any:
    """`state` with every tensor replaced by a `_Slot` (the tensor moved into `tensors`) and
    every other leaf deep-copied."""
    if isinstance(state, torch.Tensor):
        tensors[len(tensors)] = state
        return _Slot(len(tensors) - 1)
    if isinstance(state, dict):
        return _refilled(state, {key: _without_tensors(value, tensors) for key, value in state.items()})
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(_without_tensors(value, tensors) for value in state)
    return copy.deepcopy(state)


def _with_tensors(skeleton: Any, staged: dict[int, torch.Tensor]) -> Any:
    if isinstance(skeleton, _Slot):
        return staged[int(skeleton)]
    if isinstance(skeleton, dict):
        return _refilled(skeleton, {key: _with_tensors(value, staged) for key, value in skeleton.items()})
    if isinstance(skeleton, (list, tuple)) and not hasattr(skeleton, "_fields"):
        return type(skeleton)(_with_tensors(value, staged) for value in skeleton)
    return skeleton


def _refilled(like: dict, items: dict) -> dict:
    """A dict of `like`'s own kind and attributes (a module's state_dict is an OrderedDict whose
    `_metadata` its load_state_dict reads) holding `items`."""
    out = copy.copy(like)
    out.clear()
    out.update(items)
    return out
