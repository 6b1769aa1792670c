"""Live recovery of sharded state (FSDP2): each rank's shard also in its neighbour's host memory.

A rank of an FSDP run holds the only copy of its shard of the parameters and of the optimizer
state, so a lost rank's state exists nowhere else and the DDP way (a survivor broadcasts its
state) cannot work. Instead, after every step each rank r copies its shard, with the mark of that
step (data position, RNG, the loop's counters), into host memory and sends the copy to its buddy
(r + 1) mod W, on a gloo group of their own (nonblocking isend/irecv); each rank waits for its
exchange only inside the next step, after its forward/backward and before its gradient norm's
all-reduce (`wait`), so the copy travels while the step computes.

Where that wait sits is what bounds the work redone: a rank can only finish step s + 1 after
every rank has entered its gradient-norm all-reduce of step s + 1, that is after every rank has
received its neighbour's copy of step s. So when a rank is lost, its buddy holds its copy of
step M - 1 at least, M being the newest step any rank completed; at most one step is trained
again. The buddy may hold step M too (the copy landed before the loss); every survivor must
then be able to return to the chosen step, so each keeps its own snapshots of its last two
steps (its live state is the newer one). Buffers per rank, all in host memory: two own snapshots
(the one being sent and the one before) and two of the neighbour's (the last complete one and
the one arriving: a loss mid-copy leaves the previous one whole).

`restore_step` is the rule every rank of a rebuilt group applies to what the survivors report
(worker/live_recovery.py): the newest step of the lost rank's copy on its buddy to which every
survivor can return.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from worker import distributed as wdist

ALIGN = 64  # every tensor starts at a multiple of this in a buffer (a uint8 slice viewed as float64 must be aligned)
LENGTH_BYTES = 8  # a buffer starts with the length of its pickled header
# A survivor leaving a broken group waits this long for a copy still arriving (from a live
# neighbour); one that does not end by then is left, the previous one used (a step more redone).
SETTLE_WAIT = timedelta(seconds=1)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def restore_step(reports: list[dict[str, Any] | None]) -> tuple[int | None, str]:
    """The step the rebuilt group returns to, from every rank's report (`ShardCopies.report`; None
    for the newcomer, which holds nothing): the newest step of the lost rank's copy on its buddy
    that every survivor also holds a snapshot of. (None, why) when there is none."""
    lost = [r for r, report in enumerate(reports) if report is None]
    if len(lost) != 1:
        return None, f"{len(lost)} newcomers in the rebuilt group (ranks {lost}): only one lost rank is recovered at once"
    lost_rank = lost[0]
    buddy = (lost_rank + 1) % len(reports)
    held = sorted(reports[buddy]["held"], reverse=True)
    if not held:
        return None, (f"rank {buddy} holds no complete copy of rank {lost_rank}'s shard yet (lost before the first "
                      "step's copy arrived)")
    for step in held:
        if all(step in report["own"] for report in reports if report is not None):
            return step, ""
    return None, (f"rank {buddy} holds rank {lost_rank}'s shard of step(s) {', '.join(map(str, held))}, which not "
                  "every survivor can return to")


@dataclass
class _Shape:
    """Where each tensor of one rank's shard sits in its buffer."""

    capacity: int  # bytes for the pickled header (every rank the same)
    sizes: list[tuple[int, torch.dtype]]  # (numel, dtype) of each tensor, in the engine's order

    @property
    def offsets(self) -> list[int]:
        out, at = [], _aligned(LENGTH_BYTES + self.capacity)
        for numel, dtype in self.sizes:
            out.append(at)
            at = _aligned(at + numel * dtype.itemsize)
        return out

    @property
    def nbytes(self) -> int:
        if not self.sizes:
            return _aligned(LENGTH_BYTES + self.capacity)
        numel, dtype = self.sizes[-1]
        return _aligned(self.offsets[-1] + numel * dtype.itemsize)

    def buffer(self) -> torch.Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [buf[at:at + numel * dtype.itemsize].view(dtype) for at, (numel, dtype) in zip(self.offsets, self.sizes)]

    def write(self, buf: torch.Tensor, tensors: list[torch.Tensor], header: bytes) -> None:
        if len(header) > self.capacity:
            raise OverflowError(f"the step's mark ({len(header)} bytes) outgrew its slot ({self.capacity} bytes)")
        buf[:LENGTH_BYTES].view(torch.int64)[0] = len(header)
        buf[LENGTH_BYTES:LENGTH_BYTES + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        with torch.no_grad():
            for view, tensor in zip(self.views(buf), tensors):
                view.copy_(tensor.detach().reshape(-1))

    def read(self, buf: torch.Tensor, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Copy `buf` into `tensors` (in place); the header it carried."""
        with torch.no_grad():
            for view, tensor in zip(self.views(buf), tensors):
                tensor.copy_(view.view(tensor.shape))
        return header_of(buf)


def header_of(buf: torch.Tensor) -> dict[str, Any]:
    length = int(buf[:LENGTH_BYTES].view(torch.int64)[0])
    return pickle.loads(buf[LENGTH_BYTES:LENGTH_BYTES + length].numpy().tobytes())


@dataclass
class _Exchange:
    """One step's copies in flight: this rank's to its buddy, its neighbour's to this rank."""

    step: int
    sent: Any
    received: Any
    slot: int  # which of the two receive buffers it lands in


class ShardCopies:
    """One rank's side of the buddy copies. `tensors()`: the rank's shard (parameters, then the
    optimizer state), live, in an order every rank shares (`FSDPEngine.local_state`)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], rank: int, world_size: int) -> None:
        self.tensors, self.rank, self.world = tensors, rank, world_size
        self.shapes: list[_Shape] | None = None  # every rank's, known from the first copy on
        self.group: Any = None
        self.own: list[torch.Tensor] = []
        self.own_steps: list[int | None] = [None, None]
        self.received: list[torch.Tensor] = []
        self.held_steps: list[int | None] = [None, None]  # complete copies of the neighbour's shard
        self.pending: _Exchange | None = None
        self.posted = -1  # the newest step whose copy was sent

    @property
    def buddy(self) -> int:
        return (self.rank + 1) % self.world

    @property
    def neighbour(self) -> int:
        return (self.rank - 1) % self.world

    @property
    def ready(self) -> bool:
        """A complete copy of the neighbour's shard is here (and this rank's own is at its buddy)."""
        return any(step is not None for step in self.held_steps)

    def bytes_held(self) -> int:
        return sum(int(b.numel()) for b in (*self.own, *self.received))

    # ------------------------------------------------------------------ every step
    def post(self, step: int, header: dict[str, Any]) -> None:
        """After step `step` (every rank, at its mark): snapshot this rank's shard and start the
        exchange. The first one learns every rank's shard sizes and forms the copies' group (two
        collectives, once). A step already sent is not sent again."""
        if step <= self.posted:
            return
        if self.pending is not None:  # not waited inside the step (none ran): wait here
            self.wait()
        tensors = self.tensors()
        encoded = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
        if self.shapes is None:
            self._start(tensors, len(encoded))
        slot = self._older(self.own_steps)
        self.shapes[self.rank].write(self.own[slot], tensors, encoded)
        self.own_steps[slot] = step
        into = self._older(self.held_steps)
        self.held_steps[into] = None  # overwritten from now on
        self.pending = _Exchange(step, dist.isend(self.own[slot], self.buddy, group=self.group),
                                 dist.irecv(self.received[into], self.neighbour, group=self.group), into)
        self.posted = step

    def wait(self) -> bool:
        """Inside the next step, before its gradient norm's all-reduce: the exchange completes
        (raises when a peer was lost). True when this made the first complete copy here."""
        if self.pending is None:
            return False
        first = not self.ready
        exchange, self.pending = self.pending, None
        exchange.sent.wait()
        exchange.received.wait()
        self.held_steps[exchange.slot] = exchange.step
        return first

    def _start(self, tensors: list[torch.Tensor], header_bytes: int) -> None:
        mine = [(int(t.numel()), t.dtype) for t in tensors]
        every = wdist.gather_objects((header_bytes, mine))
        capacity = _aligned(2 * max(size for size, _ in every) + 4096)  # the mark may grow a little (a pickled int)
        self.shapes = [_Shape(capacity, sizes) for _, sizes in every]
        self.group = dist.new_group(backend="gloo")
        self._allocate()

    def _allocate(self) -> None:
        self.own = [self.shapes[self.rank].buffer() for _ in range(2)]
        self.received = [self.shapes[self.neighbour].buffer() for _ in range(2)]

    @staticmethod
    def _older(steps: list[int | None]) -> int:
        """The slot to overwrite: an empty one, else the older step's."""
        if steps[0] is None:
            return 0
        if steps[1] is None:
            return 1
        return 0 if steps[0] < steps[1] else 1

    # ------------------------------------------------------------------ a lost peer
    def settle(self) -> None:
        """Before leaving a broken group: a copy that finished arriving counts; one cut short does
        not (its wait raises, or has not ended within SETTLE_WAIT), and the previous complete one
        stays. (A gloo receive says it completed only through its wait.)"""
        exchange, self.pending = self.pending, None
        if exchange is None:
            return
        try:
            exchange.received.wait(SETTLE_WAIT)
        except RuntimeError:
            return
        self.held_steps[exchange.slot] = exchange.step

    def drop_group(self) -> None:
        """The copies' group belongs to the broken process group: forgotten with it."""
        self.pending, self.group = None, None

    def report(self) -> dict[str, Any]:
        """What this rank holds, for the rebuilt group's choice (`restore_step`)."""
        return {"own": sorted(s for s in self.own_steps if s is not None),
                "held": sorted(s for s in self.held_steps if s is not None),
                "shapes": None if self.shapes is None else [(shape.capacity, shape.sizes) for shape in self.shapes]}

    def restore_own(self, step: int) -> dict[str, Any]:
        """This rank's shard back to its snapshot of `step`; the header of that step."""
        return self.shapes[self.rank].read(self.own[self.own_steps.index(step)], self.tensors())

    def regroup(self) -> None:
        """Every rank of the rebuilt group, first: the copies' group over it (gloo, whatever the
        training's backend: the buffers are in host memory)."""
        self.group = dist.new_group(backend="gloo")

    def send_held(self, step: int, newcomer: int) -> None:
        """The buddy of the lost rank: its copy of `step` to the newcomer."""
        dist.send(self.received[self.held_steps.index(step)], newcomer, group=self.group)

    def receive(self, shapes: list[tuple[int, list[tuple[int, torch.dtype]]]]) -> dict[str, Any]:
        """The newcomer: its shard from its buddy, into the live tensors; the header it carried."""
        self.shapes = [_Shape(capacity, sizes) for capacity, sizes in shapes]
        self._allocate()
        dist.recv(self.own[0], self.buddy, group=self.group)
        return self.shapes[self.rank].read(self.own[0], self.tensors())

    def restart(self, step: int, header: dict[str, Any]) -> None:
        """Every rank of the rebuilt group, at `step`: this step's copies exchanged at once (the
        rebuilt group's copy of its first step must not be one step late)."""
        self.own_steps, self.held_steps, self.pending, self.posted = [None, None], [None, None], None, -1
        self.post(step, header)
        self.wait()
