"""A fault for tests: `GPUHERD_INJECT_BITFLIP=RANK:STEP:TARGET` flips one bit on one rank, once
(several faults: comma-separated).

TARGET `param`: a parameter value, right after optimizer step STEP (memory corrupted at rest);
`grad`: a gradient value, after the all-reduce and just before step STEP's update (a wrong
result of the reduction on that rank); `optim`: an AdamW moment (exp_avg), right after step
STEP. The value is the largest in magnitude of the model's middle parameter tensor (never a
zero, so the flip always matters), the bit the top bit of its mantissa. STEP counts optimizer
steps from 0, as the `step` status records do. Read by the built-in trainer only; unset, nothing
is registered. A bad value is refused in one line, exit 2 (usage).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from loguru import logger
from torch import nn

from gpuherd import contract
from gpuherd.exit_codes import ExitCode
from worker.distributed import WorkerError
from worker.sdc.fingerprint import local

TARGETS = ("param", "grad", "optim")
_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


@dataclass(frozen=True)
class Bitflip:
    rank: int
    step: int
    target: str

    def describe(self) -> str:
        return f"{contract.INJECT_BITFLIP}={self.rank}:{self.step}:{self.target}"


def parse(text: str, world_size: int) -> Bitflip:
    parts = text.split(":")
    usage = f"{contract.INJECT_BITFLIP}={text!r}: expected RANK:STEP:TARGET, TARGET one of {', '.join(TARGETS)}"
    if len(parts) != 3 or not parts[0].strip().isdigit() or not parts[1].strip().isdigit():
        raise WorkerError(usage, ExitCode.USAGE)
    rank, step, target = int(parts[0]), int(parts[1]), parts[2].strip()
    if target not in TARGETS:
        raise WorkerError(usage, ExitCode.USAGE)
    if rank >= world_size:
        raise WorkerError(f"{contract.INJECT_BITFLIP}={text!r}: rank {rank} does not exist (world size {world_size})",
                          ExitCode.USAGE)
    return Bitflip(rank, step, target)


def from_env(world_size: int) -> list[Bitflip]:
    text = os.environ.get(contract.INJECT_BITFLIP, "")
    return [parse(part.strip(), world_size) for part in text.split(",")] if text.strip() else []


def flip_top_mantissa_bit(t: torch.Tensor) -> tuple[int, int]:
    """Flip the top mantissa bit of `t`'s largest-magnitude value, in place; (index, bit)."""
    flat = local(t).detach().view(-1)
    index = int(flat.abs().argmax())
    bit = _MANTISSA_BITS[flat.dtype] - 1
    ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    ints[index] ^= 1 << bit
    return index, bit


def arm(flip: Bitflip, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer,
        current_step: Callable[[], int]) -> None:
    """Register the flip on this rank's optimizer (hooks around its step), firing once."""
    if flip.rank != rank:
        return
    named = list(model.named_parameters())
    name, param = named[len(named) // 2]
    fired = False

    def fire(tensor: torch.Tensor, what: str) -> None:
        nonlocal fired
        index, bit = flip_top_mantissa_bit(tensor)
        fired = True
        logger.warning(f"injected fault: flipped bit {bit} of {what} {name}[{index}] at step {current_step()} "
                       f"({flip.describe()})")

    def before(*_: object) -> None:
        if not fired and flip.target == "grad" and current_step() == flip.step and param.grad is not None:
            fire(param.grad, "the gradient of")

    def after(*_: object) -> None:
        if fired or current_step() != flip.step:
            return
        if flip.target == "param":
            fire(param, "parameter")
        elif flip.target == "optim" and "exp_avg" in optimizer.state.get(param, {}):
            fire(optimizer.state[param]["exp_avg"], "the AdamW exp_avg of")

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
