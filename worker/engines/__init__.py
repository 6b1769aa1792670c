"""Training strategies as `Engine` subclasses: how one model is built, wrapped,
stepped and checkpointed across ranks. torch.distributed (or DeepSpeed) does the
work; an engine only chooses and wires. `build_engine` picks the class
(factory.py); the loop and the checkpointer call the `Engine` methods (base.py)."""

from worker.engines.base import Buckets, Engine, StepCheck
from worker.engines.factory import (
    STRATEGIES,
    build_engine,
    compile_blocks,
    compile_enabled,
    needs_process_group,
    resolve_strategy,
)
from worker.engines.layout import plan_layout
from worker.engines.precision import Precision, adamw_kwargs, optimizer_groups

__all__ = [
    "STRATEGIES", "Buckets", "Engine", "Precision", "StepCheck", "adamw_kwargs", "build_engine", "compile_blocks", "compile_enabled",
    "needs_process_group", "optimizer_groups", "plan_layout", "resolve_strategy",
]
