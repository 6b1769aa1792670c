"""How this run lays the model out: the strategy, activation checkpointing and FSDP's
reduce cadence, chosen by the memory estimate (gpuherd/memory_plan.py) where the
config leaves the choice to us (`training.strategy=auto`).

The production preset is a 6B model: on 8 x 80 GB it fits only as FSDP with
per-micro-batch reduce-scatters, with fewer GPUs only with activation
checkpointing too, and on one GPU not at all (16 B/param of AdamW state alone).
Guessing DDP there would OOM after minutes of start-up; the estimate says so at
once, in one line, before anything is allocated.
"""

from __future__ import annotations

from loguru import logger

from gpuherd.config import Config
from gpuherd.exit_codes import ExitCode
from gpuherd.memory_plan import GIB, Choice, Layout, ModelShape, Workload, choose_layout
from worker.distributed import WorkerError
from worker.engines.factory import resolve_strategy


def plan_layout(cfg: Config, vocab_size: int, world_size: int, device_bytes: int | None) -> tuple[Layout, str | None]:
    """(layout, what to say about it in the start-up line). `device_bytes`: the smallest
    GPU of the run (None on CPU: no estimate, the configured layout as is)."""
    t = cfg.training
    strategy = resolve_strategy(t.strategy, world_size)
    configured = Layout(strategy, t.gradient_checkpointing)
    if device_bytes is None:
        return configured, None
    shape = ModelShape.of(cfg.model, vocab_size)
    work = Workload(world_size, t.batch_size, cfg.data.context_length, t.grad_accum_nums)
    requested = t.strategy if t.strategy in ("auto", "fsdp") else strategy
    choice = choose_layout(shape, work, device_bytes, requested, t.gradient_checkpointing)
    if choice is None:  # zero1 / deepspeed: sharding configured elsewhere
        return configured, None
    if not choice.fits:
        _does_not_fit(choice, shape, world_size)
    return choice.layout, choice.note()


def _does_not_fit(choice: Choice, shape: ModelShape, world_size: int) -> None:
    gpus = f"{world_size} GPU{'s' if world_size > 1 else ''} of {choice.device_bytes / GIB:.1f} GiB"
    what = (f"the model ({shape.params / 1e9:.2f}B parameters) needs ~{choice.estimate.gib()} per GPU even as "
            f"{choice.layout.describe()}, more than {gpus}")
    if choice.chosen:
        raise WorkerError(f"{what}; use more GPUs, a smaller model (--preset gpt2-small) or a smaller "
                          "training.batch_size", ExitCode.USAGE)
    logger.warning(f"{what}: this will probably run out of memory; training.strategy=auto lets the memory "
                   "estimate choose sharding and activation checkpointing")
