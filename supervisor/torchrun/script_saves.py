"""What gpuherd saw of a `--script`'s own saves, and the words every line about them uses.

gpuherd writes no checkpoint for a script and cannot know what the script will resume from.
What it can say is what it saw: the `script_save` records (a `torch.save` or
`torch.distributed.checkpoint.save` the script bootstrap watched return, or a framework's
checkpoint told by a callback of gpuherd/integrations/), each with its rank, path and step,
and when it came. One `ScriptSaves` for the run keeps the newest save of each rank (an attempt
that saved nothing resumed, if at all, from an earlier attempt's) and the last step each rank
reported in the attempt under way; the restart line, the summary's attempt record and the end
of a stop (did a save follow the signal?) all read it, so they say the same thing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gpuherd.status_records import Record, ScriptSave, Step

FRAMEWORKS = {"lightning": "Lightning", "transformers": "transformers"}  # api -> its name in a line
NONE_SEEN = ("gpuherd saw no save by the script (no torch.save, torch.distributed.checkpoint save or framework "
             "checkpoint returned after its first optimizer step)")
UNWATCHED = ("gpuherd cannot see the script's saves (it runs without the heartbeat bootstrap: --no-auto-heartbeat, "
             "--no-python)")


@dataclass(frozen=True)
class SeenSave:
    rank: int | None
    step: int | None
    path: str | None
    api: str
    seen_at: float  # time.monotonic() when its record came
    attempt: int = 0  # the attempt it came in

    def what(self) -> str:
        """`rank 0's torch.save to /x/last.pt after 40 optimizer step(s) of attempt 0`."""
        who = f"rank {self.rank}'s" if self.rank is not None else "a rank's"
        framework = FRAMEWORKS.get(self.api)
        if framework is not None:  # the framework's own step count (it goes on across a resume)
            where = f" {self.path}" if self.path else ""
            return f"{who} {framework} checkpoint{where}" + (f" at step {self.step}" if self.step is not None else "")
        where = f" to {self.path}" if self.path else " to a buffer or unnamed file (no path)"
        steps = "" if self.step is None else f" after {self.step} optimizer step(s) of attempt {self.attempt}"
        return f"{who} {self.api}{where}{steps}"

    def to_dict(self, until: float | None, last_step: int | None) -> dict:
        return {"rank": self.rank, "step": self.step, "path": self.path, "api": self.api, "attempt": self.attempt,
                "before_s": None if until is None else round(max(0.0, until - self.seen_at), 3),
                "last_step": last_step}


class ScriptSaves:
    """The run's saves, as the status records came (`observe` is an on-record observer)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, watched: bool = True) -> None:
        self.clock = clock
        self.none_seen = NONE_SEEN if watched else UNWATCHED  # watched: the bootstrap runs the script
        self.attempt = 0  # the attempt under way
        self.newest: dict[int | None, SeenSave] = {}  # rank -> its newest save
        self.steps: dict[int | None, int] = {}  # rank -> the highest step it reported in the attempt under way

    def begin(self, attempt: int) -> None:
        """Attempt `attempt` starts: its ranks count their steps afresh (the bootstrap's from 0)."""
        self.attempt, self.steps = attempt, {}

    def _last_step(self, save: SeenSave) -> int | None:
        return self.steps.get(save.rank) if save.attempt == self.attempt else None

    def observe(self, record: Record) -> None:
        if isinstance(record, ScriptSave):
            self.newest[record.rank] = SeenSave(record.rank, record.step, record.path, record.api or "a save",
                                                self.clock(), self.attempt)
        elif isinstance(record, Step) and record.step is not None:
            self.steps[record.rank] = max(record.step, self.steps.get(record.rank, record.step))

    def last(self, before: float | None = None) -> SeenSave | None:
        """The newest save of any rank (seen before `before`, monotonic, when given)."""
        seen = [s for s in self.newest.values() if before is None or s.seen_at <= before]
        return max(seen, key=lambda s: s.seen_at, default=None)

    def record(self, until: float | None) -> dict:
        """For the summary's attempt record: the last save seen up to `until` ({} : none)."""
        save = self.last(until)
        return {} if save is None else save.to_dict(until, self._last_step(save))

    def said(self, until: float | None, event: str = "the failure") -> str:
        """`the last save gpuherd saw: rank 0's ... , 1.2 s before the failure (its last step reported: 45)`."""
        save = self.last(until)
        if save is None:
            return self.none_seen
        return f"the last save gpuherd saw: {said_of(save.to_dict(until, self._last_step(save)), save, event)}"

    def after_signal(self, since: float) -> str:
        """A stop: whether a save followed the signal (sent at `since`, monotonic)."""
        followed = [s for s in self.newest.values() if s.seen_at >= since]
        if followed:
            save = max(followed, key=lambda s: s.seen_at)
            return f"the script saved after the signal: {save.what()}"
        before = self.last(since)
        if before is None:
            return "no save followed the signal, and " + self.none_seen.replace("gpuherd saw", "gpuherd had seen", 1)
        d = before.to_dict(since, self._last_step(before))
        return f"no save followed the signal (the last save gpuherd saw: {said_of(d, before, 'the signal')})"


def said_of(d: dict, save: SeenSave, event: str) -> str:
    when = f", {d['before_s']:.1f} s before {event}" if d.get("before_s") is not None else ""
    later = d.get("last_step")
    steps = f" (its last step reported: {later})" if later is not None and save.step is not None \
        and later > save.step else ""
    return f"{save.what()}{when}{steps}"
