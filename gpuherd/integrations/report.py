"""What a framework callback sends: the framework's steps (at most every STEP_EVERY s) and its
checkpoints (phase `checkpoint` while it writes, then a `script_save` record with its path)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from gpuherd.status_channel import StatusWriter

STEP_EVERY = 0.5  # seconds between step records, as the script bootstrap's heartbeats


class FrameworkReport:
    def __init__(self, api: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.api, self.clock = api, clock
        self.writer = StatusWriter.from_env(int(os.environ.get("RANK", "0")))
        self.last_sent: float | None = None
        self.saving_since: float | None = None

    @property
    def active(self) -> bool:
        """Under gpuherd (a status fd); elsewhere every call is a no-op."""
        return self.writer.connected

    def take_over(self) -> None:
        """From now on the framework's numbering of steps is the one gpuherd hears: the script
        bootstrap's own optimizer-step counts stop (they restart at 0 after a resume)."""
        if self.active:
            StatusWriter.explicit_records = True

    def step(self, step: int) -> None:
        now = self.clock()
        if self.last_sent is None or now - self.last_sent >= STEP_EVERY:
            self.writer.send("step", step=int(step))
            self.last_sent = now

    def save_began(self) -> None:
        self.writer.send("phase", name="checkpoint")
        self.saving_since = self.clock()

    def save_ended(self, step: int | None, path: str | None) -> None:
        """The framework's checkpoint is written (`step`, `path` None: it failed, no record of it)."""
        since, self.saving_since = self.saving_since, None
        if path is not None:
            self.writer.send("script_save", step=step, path=os.path.abspath(path) if "://" not in path else path,
                             api=self.api, seconds=None if since is None else round(self.clock() - since, 4))
        if since is not None:
            self.writer.send("phase", name="train")
