"""A save's copy of the state, taken into a buffer that outlives the save and that the
long-lived writer process (worker/save_writer.py) reads as it is: no fork per save, no
pickle of tensor bytes, no allocation after the start.

The buffer is one shared anonymous mapping, made before the writer is forked (so both map
it, and no file descriptor, /dev/shm file or file-size limit is involved), sized to the
state's estimate with room to spare; only the pages a save writes are ever backed by
memory. The state is pickled with every tensor replaced by a slot number (`persistent_id`):
that pickle is the save's frozen copy of everything that is not a tensor (param groups,
learning rates, meta), made in microseconds. The tensors are copied into the buffer at
64-byte aligned offsets, 4096-byte aligned for any tensor that large, so the writer sends
them to the disk straight from the buffer (worker/direct_sink.py). On CUDA the used part is
registered as pinned memory, so the device-to-host copies run at full speed, non-blocking,
with one synchronize at the end.

The writer rebuilds the state from the pickle, each slot a tensor whose storage is exactly
its bytes in the buffer (so torch.save writes each tensor's own storage, as for the live
state; tied tensors share one slot, as they share one storage). It must be done with the
buffer before the loop copies the next save into it: worker/saver.py lets at most one write
be in flight, and a save first waits for the previous write.
"""

from __future__ import annotations

import io
import mmap
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from worker.direct_sink import ALIGN as DIRECT_ALIGN

ALIGN = 64  # every slot; one of DIRECT_ALIGN bytes or more starts DIRECT_ALIGN-aligned, so the writer
# sends it to the disk straight from the buffer (worker/direct_sink.py)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value; Python < 3.13 lacks the name


@dataclass(frozen=True)
class Slot:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class Snapshot:
    """One save's frozen state: the pickle (tensors as slot numbers) and where each slot lies
    in the buffer."""

    skeleton: bytes
    slots: tuple[Slot, ...]


class TooLarge(Exception):
    """The state outgrew the buffer reserved at the start (the saver then writes it blocking)."""


class Region:
    """The shared buffer and the loop's view of it (a flat uint8 tensor)."""

    def __init__(self, size: int) -> None:
        self.size = max(size, ALIGN)
        self.map = mmap.mmap(-1, self.size)  # MAP_SHARED | MAP_ANONYMOUS: a forked child sees the same pages
        self.flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self.pinned = 0  # bytes registered with CUDA

    def pin(self, nbytes: int) -> None:
        """The first `nbytes` page-locked for CUDA's copies (best effort: without it the copies
        still work, slower)."""
        if nbytes <= self.pinned:
            return
        self.unpin()
        try:
            if torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), nbytes, 0) == 0:
                self.pinned = nbytes
        except (RuntimeError, AttributeError):
            pass

    def unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self.pinned = 0

    def populate(self, nbytes: int) -> None:
        """Back the first `nbytes` with memory and map them in this process now, contents
        untouched (MADV_POPULATE_WRITE, Linux >= 5.14; elsewhere the first save's copy takes
        the page faults). The loop does it before training on a CPU run, the writer as it
        starts (then only mapping pages the loop backed), so neither the first save's copy
        nor its write faults in every page of a fresh buffer; safe alongside a copy, as
        nothing is written."""
        try:
            self.map.madvise(MADV_POPULATE_WRITE, 0, min(nbytes, self.size) // mmap.PAGESIZE * mmap.PAGESIZE)
        except (OSError, ValueError, AttributeError):
            pass

    def close(self) -> None:
        self.unpin()
        del self.flat
        self.map.close()


def reserve_bytes(state_bytes: int, world_size: int) -> int:
    """The buffer for a state estimated at `state_bytes`: a quarter more (the estimate counts
    parameters, not the optimizer's scalars nor alignment), plus room for the meta block's
    per-rank RNG and sampler tensors. Untouched pages cost no memory."""
    return state_bytes + state_bytes // 4 + (64 << 20) + world_size * (64 << 10)


class SnapshotTaker:
    """The loop's side: copies a state into the buffer."""

    def __init__(self, device: torch.device, reserve: int, expected: int) -> None:
        """`expected`: the bytes a save is expected to take (the writer backs them at its start).
        On a CPU run the loop backs and maps them itself, now, before training (and before the
        writer is forked, which then shares the pages without copying its page tables): else the
        first save's copy takes a page fault per 4 KB page (0.1 s of CPU per 155 MB), which makes
        the first save cost the loop more than the others. On CUDA they are pinned now, for the
        same reason: registering them backs and locks every page, which the first save paid (an
        H100 run's first async save of a 124M model stalled its loop 0.8 s, copies included)."""
        self.device, self.expected = device, expected
        self.region = Region(reserve)
        if device.type == "cpu":
            self.region.populate(expected)
        elif device.type == "cuda":
            self.region.pin(min(expected, self.region.size))

    def take(self, state: Any) -> Snapshot:
        tensors: list[torch.Tensor] = []
        skeleton = _pickle_skeleton(state, tensors)
        slots = _layout(tensors)
        used = max((s.offset + s.nbytes for s in slots), default=0)
        if used > self.region.size:
            raise TooLarge(f"the state takes {used} bytes, more than the {self.region.size} reserved at the start")
        cuda = any(t.is_cuda for t in tensors)
        if cuda:
            self.region.pin(used)
        for tensor, slot in zip(tensors, slots, strict=True):
            if slot.nbytes:
                view(self.region.flat, slot).copy_(tensor.detach(), non_blocking=cuda and self.region.pinned >= used)
        if cuda:
            torch.cuda.synchronize(self.device)
        return Snapshot(skeleton, tuple(slots))

    def close(self) -> None:
        self.region.close()


def view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The slot's tensor in the loop's flat view of the region."""
    return flat[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)


def rebuild(snapshot: Snapshot, region: mmap.mmap) -> Any:
    """The writer's side: the state, each tensor backed by its own bytes of `region`."""
    def tensor(slot: Slot) -> torch.Tensor:
        if not slot.nbytes:
            return torch.empty(slot.shape, dtype=slot.dtype)
        raw = torch.frombuffer(region, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
        return raw.view(slot.dtype).view(slot.shape)

    built = [tensor(slot) for slot in snapshot.slots]
    unpickler = pickle.Unpickler(io.BytesIO(snapshot.skeleton))
    unpickler.persistent_load = lambda number: built[number]
    return unpickler.load()


def _pickle_skeleton(state: Any, tensors: list[torch.Tensor]) -> bytes:
    """`state` pickled with each distinct tensor (by identity) replaced by its slot number."""
    numbers: dict[int, int] = {}

    def persistent_id(obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in numbers:
            numbers[id(obj)] = len(tensors)
            tensors.append(obj)
        return numbers[id(obj)]

    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = persistent_id
    pickler.dump(state)
    return out.getvalue()


def _layout(tensors: list[torch.Tensor]) -> list[Slot]:
    slots, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        align = DIRECT_ALIGN if nbytes >= DIRECT_ALIGN else ALIGN
        offset = -(-offset // align) * align
        slots.append(Slot(offset, tensor.dtype, tuple(tensor.shape)))
        offset += nbytes
    return slots


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
