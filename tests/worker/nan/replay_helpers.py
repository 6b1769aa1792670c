"""Shared pieces for the suspicious-step tests (spikes, rerun, replay): configs, a
training step that can be replayed as the worker's loop replays it, and the two
fault injectors the rerun policy must tell apart: a one-off corruption of a
gradient (a flaky device) and a loss scaled on every run of one batch (data)."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import torch
from torch import nn

from gpuherd.config import Config
from tests.worker.nan.helpers import make_config


def suspicious_config(checkpoint_dir: Path, nan_policy: str = "stop", spike_policy: str = "off",
                      hooks: bool = False, **debug: object) -> Config:
    """Spikes judged from the 4th applied step on, over the last 8."""
    cfg = make_config(checkpoint_dir, hooks=hooks, policy=nan_policy)
    cfg.debug.spike_policy = spike_policy
    cfg.debug.spike_window, cfg.debug.spike_warmup, cfg.debug.spike_k = 8, 3, 6.0
    for key, value in debug.items():
        setattr(cfg.debug, key, value)
    return cfg


class LossScale:
    """Scales micro-batch 0's loss: `always` on every run of the step (the batch
    itself is bad), `once` on its first run only (a one-off fault)."""

    def __init__(self, always: float = 1.0, once: float = 1.0) -> None:
        self.always, self.once, self.runs = always, once, 0

    def next_run(self) -> float:
        self.runs += 1
        return self.always * (self.once if self.runs == 1 else 1.0)


def replayable_step(model: nn.Module, optimizer: torch.optim.Optimizer, guard, step: int,
                    batches: list[torch.Tensor], lr: float, scale: LossScale | None = None,
                    begin: bool = True, max_norm: float = 1.0) -> bool:
    """The worker's loop reduced to what the guard sees, with the replay it hands over.
    `begin=False`: the caller called `guard.begin_step(source)` before drawing `batches`."""
    scale = scale or LossScale()

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        factor = scale.next_run()
        total = torch.zeros(())
        for i, mb in enumerate(batches):
            loss = model(mb) * (factor if i == 0 else 1.0) / len(batches)
            loss.backward()
            total = total + loss.detach()
        return total, torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    optimizer.zero_grad(set_to_none=True)
    if begin:
        guard.begin_step(None)
    loss, grad_norm = forward_backward()
    apply = guard.check(step=step, loss=loss, grad_norm=grad_norm, batches=batches, lr=lr, replay=forward_backward)
    if apply:
        optimizer.step()
    return apply


class GradientFault:
    """A flaky device in miniature: the next gradient of `param` comes out NaN (or
    multiplied by `factor`) once, when armed; a replay of the step is clean."""

    def __init__(self, param: nn.Parameter, factor: float = float("nan")) -> None:
        self.factor, self.armed, self.fired = factor, False, 0
        self.handle = param.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return grad
        self.armed = False
        self.fired += 1
        return grad * self.factor

    def remove(self) -> None:
        self.handle.remove()


def status_file(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def records(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []
