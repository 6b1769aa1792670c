"""Engines stepped by a torch optimizer (single, DDP, ZeRO-1, FSDP): gradient
accumulation, clipping, the grad scaler, and full-state or DCP checkpoints.

A full-state file (`step_N.pt`) and a DCP directory can each be resumed by any
of these strategies: state dicts are keyed by parameter name, whatever wrapped
the model. Only ZeRO-1 keys optimizer state by parameter index (`optimizer_format`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from gpuherd.exit_codes import ExitCode
from worker.checkpoint_io import FORMAT_DCP, FORMAT_DEEPSPEED, FORMAT_FILE, load_file, save_checkpoint_file
from worker.distributed import WorkerError
from worker.engines.base import Build, Engine, StepCheck
from worker.model import Transformer


@dataclass
class TorchEngine(Engine):
    optimizer_format: ClassVar[str] = "fqn"  # how a full-state file keys the optimizer state

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, model: Transformer, build: Build, counts: dict[str, int]) -> Engine:
        wrapped = cls.wrap(model, build)
        optimizer = cls.make_optimizer(model, build)
        scaler = torch.amp.GradScaler(build.device.type) if build.precision.use_scaler else None
        return cls(wrapped, model, optimizer, build.device, build.precision, build.cfg.training.grad_accum_nums,
                   scaler=scaler, _params=[p for p in model.parameters() if p.requires_grad], **counts)

    @classmethod
    def wrap(cls, model: Transformer, build: Build) -> nn.Module:
        """What forward() is called on. Default: the model itself."""
        return model

    # ------------------------------------------------------------------ one step
    def micro_step(self, inputs: torch.Tensor, targets: torch.Tensor, is_last: bool) -> torch.Tensor:
        with self.sync_context(is_last):
            with self.autocast():
                loss = self.model(inputs, targets)
            scaled = loss / self.grad_accum
            if self.scaler is not None:
                scaled = self.scaler.scale(scaled)
            scaled.backward()
        return loss.detach()

    def sync_context(self, is_last: bool) -> contextlib.AbstractContextManager:
        """Around one micro-batch's backward: where gradients are (not yet) reduced across ranks."""
        return contextlib.nullcontext()

    def step(self, lr: float, max_grad_norm: float, check: StepCheck | None) -> tuple[torch.Tensor | None, bool]:
        norm = self.clip_grad_norm(max_grad_norm)
        if check is not None and not check(norm, lambda: self.clip_grad_norm(max_grad_norm)):
            self.skip_step()
            return norm, False
        self.optimizer_step(lr)
        return norm, True

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Total gradient norm (a tensor, no host sync), clipping when max_norm > 0."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        total = self.total_norm([p.grad for p in self._params if p.grad is not None])
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self._params, max_norm, total, foreach=True)
        return total

    def total_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.get_total_norm(grads, foreach=True)

    def optimizer_step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Drop this step's gradients (the NaN guard said so); keep the scaler consistent."""
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checkpoints
    def prepare_capture(self) -> None:
        # the state-dict helpers import torch.distributed.checkpoint: ~0.3-0.7 s of CPU on both
        # ranks, which would otherwise fall into the first save
        import torch.distributed.checkpoint.state_dict  # noqa: F401

    def capture_states(self, rank: int, to_host: bool) -> dict[str, Any] | None:
        """The full state, on rank 0 only (the one that writes the file)."""
        model_sd = self.full_model_state(to_host)
        optim_sd = self.full_optimizer_state(rank, to_host)
        return {"model": model_sd, "optimizer": optim_sd} if rank == 0 else None

    def write_states(self, states: dict[str, Any] | None, path: Path, meta: dict[str, Any], rank: int,
                     group: Any = None) -> None:
        """One full-state file and its manifest, written by rank 0 (no collective)."""
        if rank == 0:
            save_checkpoint_file({"format": FORMAT_FILE, "model": states["model"], "optimizer": states["optimizer"],
                                  "optimizer_format": self.optimizer_format, "meta": meta}, path)

    def full_model_state(self, to_host: bool = True) -> dict[str, Any]:
        """The whole model (a collective). `to_host`: on the CPU of rank 0 only (other ranks get
        {}): eight ranks each copying a 1B model to host memory would hold eight copies for one
        file. Else the live tensors, which the async saver copies into its staging buffers."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.inner, options=StateDictOptions(full_state_dict=True, cpu_offload=to_host))

    def full_optimizer_state(self, rank: int, to_host: bool = True) -> dict[str, Any] | None:
        """The whole optimizer state keyed by parameter name (a collective); rank 0 writes it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.inner, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=to_host))

    def load_states(self, path: Path, fmt: str) -> None:
        if fmt == FORMAT_DEEPSPEED:
            raise WorkerError(f"{path} is a DeepSpeed checkpoint; resume it with training.strategy=deepspeed",
                              ExitCode.USAGE)
        if fmt == FORMAT_DCP:
            self._load_dcp(path)
            return
        ckpt = load_file(path)
        saved = ckpt["optimizer_format"]
        if saved != self.optimizer_format:
            raise WorkerError(f"{path}: optimizer state saved as '{saved}' cannot be loaded by strategy "
                              f"{self.strategy}; resume with the strategy that wrote it", ExitCode.USAGE)
        self.load_full_states(ckpt)

    def load_full_states(self, ckpt: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(self.inner, self.optimizer, model_state_dict=ckpt["model"],
                       optim_state_dict=ckpt["optimizer"], options=StateDictOptions(full_state_dict=True))

    def _load_dcp(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.inner, self.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.inner, self.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optimizer"])


@dataclass
class SingleEngine(TorchEngine):
    """One worker, no wrapping: the plain training step."""

    strategy: ClassVar[str] = "single"
    needs_process_group: ClassVar[bool] = False
