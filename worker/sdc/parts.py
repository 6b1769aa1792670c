"""What the silent-data-corruption check is built from, named one by one (not the trainer whole):
the settings it reads, frozen; the group the replicas are compared in; and the training loop's
side of a check: its step counter and what a rollback (heal.Kept) reads and sets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from worker.save_schedule import SaveSchedule
    from gpuherd.config import TrainingConfig


@dataclass(frozen=True)
class SdcSettings:
    every: int  # training.sdc_check_every: parameters compared every N optimizer steps (0: off)
    optim_every: int  # training.sdc_optim_check_every: optimizer state too (FSDP: a recompute of the step)
    saves: SaveSchedule  # the trainer's: a check is due before every checkpoint
    strategy: str  # the layout's strategy: what of the state is replicated

    @classmethod
    def of(cls, training: TrainingConfig, saves: SaveSchedule, strategy: str) -> SdcSettings:
        return cls(training.sdc_check_every, training.sdc_optim_check_every, saves, strategy)


class Group(Protocol):
    """The data-parallel group, as live recovery keeps it (worker/live_recovery.py): its members in
    group order (fewer than the job's ranks after a shrink), and its generation (a rebuilt group
    has a new one)."""

    ranks: list[int]
    generation: int


@dataclass(frozen=True)
class Loop:
    """The training loop's side of a check. `step`: completed steps, read when needed; the counters
    (`state_dict`/`load_state_dict` of the loop) and the data position are what a rollback keeps
    and puts back; `exclude_pause`: the time a rollback took is no training time."""

    step: Callable[[], int]
    counters: Callable[[], dict[str, Any]]
    load_counters: Callable[[dict[str, Any]], None]
    data_position: Callable[[], dict[str, Any]]
    rewind_data: Callable[[dict[str, Any]], None]
    exclude_pause: Callable[[float], None]
