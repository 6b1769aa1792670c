"""When the built-in trainer saves, said once: every `training.save_every` completed steps a
periodic checkpoint (none after the last step: the final save writes that one), and the final
save after `training.max_steps`. The loop asks it what is due after a step; the silent data
corruption check asks it which states are about to be saved (it compares the replicas before
each, so no unchecked state is written)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpuherd.config import TrainingConfig


@dataclass(frozen=True)
class SaveSchedule:
    every: int  # training.save_every (0: only the final save)
    max_steps: int  # training.max_steps: the final save follows it

    @classmethod
    def of(cls, training: TrainingConfig) -> SaveSchedule:
        return cls(training.save_every, training.max_steps)

    @property
    def periodic_saves(self) -> bool:
        return self.every > 0

    def periodic_after(self, done: int) -> bool:
        """A periodic checkpoint follows completed step `done`."""
        return bool(self.every) and done % self.every == 0 and done < self.max_steps

    def saved_after(self, done: int) -> bool:
        """The state after completed step `done` is written: a periodic checkpoint, or the final save."""
        return done == self.max_steps or self.periodic_after(done)
