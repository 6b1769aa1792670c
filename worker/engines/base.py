"""The `Engine` interface: one built, wrapped, initialised model with its optimizer.

The training loop and the checkpointer call only these methods; each strategy
(a subclass, one per file) decides how they are done, so neither branches on
strategy names.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from gpuherd.config import Config
from gpuherd.ddp_buckets import Buckets  # gradient buckets in reduction order (DDP's own description)
from gpuherd.memory_plan import Layout
from worker.engines.precision import Precision, adamw_kwargs, optimizer_groups
from worker.model import Transformer

# The NaN guard's verdict on a step's loss and gradient norm: True = apply the step. Its
# second argument clips the gradients again and returns their norm, so the guard can replay
# the step's micro-batches (policy rerun); None where the check comes after the optimizer
# step and the step can no longer be replayed.
StepCheck = Callable[[torch.Tensor | None, Callable[[], torch.Tensor] | None], bool]



@dataclass(frozen=True)
class Build:
    """What constructing any engine needs besides the model itself."""

    cfg: Config
    device: torch.device
    precision: Precision
    world_size: int
    layout: Layout  # strategy, activation checkpointing, FSDP reduce cadence (the memory plan)
    joining: bool = False  # a spare replacing a lost rank: no collectives while building (its peers do none)
    buckets: Buckets | None = None  # the gradient buckets its peers reduce in (DDP; live recovery)


@dataclass
class Engine(ABC):
    strategy: ClassVar[str]
    sharded: ClassVar[bool] = False  # checkpoints are per-rank directories, not one file
    needs_process_group: ClassVar[bool] = True  # even with a single worker
    # A lost rank's state exists on a survivor, so live recovery can hand it to a spare
    # (worker/live_recovery.py): every rank holds the whole state (DDP), or, with `shard_copies`,
    # each rank's shard is copied to its neighbour after every step (worker/shard_copies.py: FSDP,
    # the tensors `local_state()` lists). ZeRO-1 and DeepSpeed: their optimizer shards exist nowhere else.
    live_recoverable: ClassVar[bool] = False
    shard_copies: ClassVar[bool] = False

    model: nn.Module  # what forward() is called on (wrapped)
    inner: Transformer  # the unwrapped module: names, parameters, accounting
    optimizer: Any
    device: torch.device
    precision: Precision
    grad_accum: int
    scaler: torch.amp.GradScaler | None = None
    _params: list[nn.Parameter] = field(default_factory=list)
    buckets: Buckets | None = None  # the gradient buckets of the group drop_group() left (live recovery)
    # Counted on the meta model: ZeRO-3 partitions leave p.numel() == 0 afterwards.
    n_params: int = 0
    n_matmul_params: int = 0

    # ------------------------------------------------------------------ construction
    @classmethod  # noqa: B027 - a hook whose default is to do nothing
    def shard(cls, model: Transformer, build: Build) -> None:
        """Called on the meta-device model, before its weights exist: shard it in place
        where the strategy shards parameters (FSDP). Default: nothing."""

    @classmethod
    @abstractmethod
    def create(cls, model: Transformer, build: Build, counts: dict[str, int]) -> Engine:
        """Wrap the materialised, initialised `model` and give it an optimizer."""

    @classmethod
    def make_optimizer(cls, model: Transformer, build: Build) -> Any:
        """AdamW over nanoGPT's decay / no-decay groups."""
        return torch.optim.AdamW(optimizer_groups(model, build.cfg.training.weight_decay),
                                 **adamw_kwargs(build.cfg, build.device))

    def drop_group(self) -> None:
        """Live recovery, before the broken group is destroyed: let go of everything that holds it,
        so it really closes its connections (a peer still waiting in a collective on this rank
        is freed only then), keeping in `buckets` the order its gradients were reduced in. Only
        where live_recoverable."""
        raise NotImplementedError(f"strategy {self.strategy} cannot rejoin a rebuilt process group")

    def regroup(self, buckets: Buckets | None) -> None:
        """After the process group was rebuilt (live recovery): wrap the model again over the new
        group (FSDP: point its modules at it), without collectives (the state comes from a survivor
        next), reducing gradients in `buckets` (DDP; every rank the same). Only where live_recoverable."""
        raise NotImplementedError(f"strategy {self.strategy} cannot rejoin a rebuilt process group")

    def local_state(self) -> list[torch.Tensor]:
        """This rank's shard of model and optimizer state, live (only where shard_copies)."""
        raise NotImplementedError(f"strategy {self.strategy} keeps no shard copies")

    # ------------------------------------------------------------------ the loop's calls
    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.autocast_dtype)

    @abstractmethod
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool) -> torch.Tensor:
        """Forward + backward of one micro-batch; returns the detached loss."""

    @abstractmethod
    def step(self, lr: float, max_grad_norm: float, check: StepCheck | None) -> tuple[torch.Tensor | None, bool]:
        """Finish the optimizer step after the last micro-batch: clip (max_grad_norm > 0),
        let `check` veto it, step or drop the gradients. Returns (total grad norm, applied)."""

    # ------------------------------------------------------------------ checkpoints
    # Its state can be captured, copied to host memory and written by another thread while
    # training goes on (worker/saver.py); False: every save blocks the loop (DeepSpeed).
    async_capable: ClassVar[bool] = True

    @abstractmethod
    def capture_states(self, rank: int, to_host: bool) -> dict[str, Any] | None:
        """What this rank writes of model + optimizer state (a collective: all ranks call), or
        None where it writes nothing. `to_host` False: tensors may still be the live ones on
        the device (the caller copies them to host memory before training goes on)."""

    @abstractmethod
    def write_states(self, states: dict[str, Any] | None, path: Path, meta: dict[str, Any], rank: int,
                     group: Any = None) -> None:
        """Write what `capture_states` returned, and `meta`, to `path` (a collective over
        `group`, default the world, where every rank writes a part)."""

    def prepare_capture(self) -> None:
        """Before training: load what the first capture would load (its modules), so the first
        save costs the loop what the others do. Every run ends with a save, so nothing is loaded
        for nothing."""

    def save_states(self, path: Path, meta: dict[str, Any], rank: int) -> None:
        """Capture and write in one go (a collective: all ranks call)."""
        self.write_states(self.capture_states(rank, to_host=True), path, meta, rank)

    @abstractmethod
    def load_states(self, path: Path, fmt: str) -> None:
        """Restore model + optimizer state from `path`, written in format `fmt`."""
