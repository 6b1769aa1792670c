"""A nested training state (state dicts, RNG states, plain values) from one rank to all others.

The structure travels pickled, with every tensor replaced by its shape, dtype and device
kind; the tensors follow one broadcast each, on the device the backend can carry (CPU for
gloo, the rank's GPU for NCCL), and land on the device kind they came from. Bytes are
copied, never recomputed: the receivers hold the source's exact values.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_gpu: bool


def _map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """`obj` with every leaf (whatever is not a dict, list or tuple) replaced by `fn(leaf)`,
    visited in one fixed order."""
    if isinstance(obj, dict):
        return {key: _map_leaves(value, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_leaves(value, fn) for value in obj]
        return items if isinstance(obj, list) else tuple(items)
    return fn(obj)


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    def slot(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf)
        return _TensorSlot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype, leaf.device.type == "cuda")
    return _map_leaves(obj, slot)


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    return _map_leaves(obj, lambda leaf: tensors[leaf.index] if isinstance(leaf, _TensorSlot) else leaf)


def _slots(obj: Any) -> list[_TensorSlot]:
    found: list[_TensorSlot] = []
    _map_leaves(obj, lambda leaf: found.append(leaf) if isinstance(leaf, _TensorSlot) else None)
    return found


def broadcast_state(state: Any, src: int, device: torch.device) -> Any:
    """`state` on rank `src` (None elsewhere) -> the same state on every rank (a collective)."""
    wire = device if dist.get_backend() == "nccl" else torch.device("cpu")
    tensors: list[torch.Tensor] = []
    skeleton = [_strip(state, tensors) if dist.get_rank() == src else None]
    dist.broadcast_object_list(skeleton, src=src, device=wire if wire.type == "cuda" else None)
    slots = sorted(_slots(skeleton[0]), key=lambda slot: slot.index)
    received: list[torch.Tensor] = []
    for slot in slots:
        if dist.get_rank() == src:
            buf = tensors[slot.index].detach().to(wire).contiguous()
        else:
            buf = torch.empty(slot.shape, dtype=slot.dtype, device=wire)
        dist.broadcast(buf, src=src)
        home = device if slot.on_gpu else torch.device("cpu")
        received.append(buf if dist.get_rank() == src else buf.to(home))
    return state if dist.get_rank() == src else _fill(skeleton[0], received)
