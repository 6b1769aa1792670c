"""The heartbeat judge's side of the supervision loop (supervision.py): when the kernel's view of
the workers (/proc) is read for it, and what it says of the live ranks.

/proc is read every PROC_SAMPLE_S, and out of turn when a SIGCHLD came (the kernel tells the
parent at once when a child stops, continues or exits) or when a stopped rank is due to be
judged (Heartbeats.stop_due). Once the attempt has a cause nothing is judged any more.
"""

from __future__ import annotations

from loguru import logger

from supervisor.health import PROC_SAMPLE_S, HangVerdict, Heartbeats, ProcReader
from supervisor.summary import RootCause


class HangWatch:
    def __init__(self, heartbeats: Heartbeats, unwatched_why: str | None) -> None:
        """`unwatched_why`: said once for ranks that never send a heartbeat (None: nothing said)."""
        self.heartbeats = heartbeats
        self.unwatched_why = unwatched_why
        self.procs = ProcReader()  # the kernel's view of each worker, handed to the hang judge
        self._read_at = float("-inf")

    def read_now(self) -> None:
        """A SIGCHLD came: a worker stopped, continued or exited: /proc is read at the next look."""
        self._read_at = float("-inf")

    def stop_due(self, cause: RootCause | None) -> float | None:
        """When the decisive rule for a stopped rank wants its /proc read (Heartbeats.stop_due): a
        stopped rank is judged the moment it has been stopped DECISIVE_STOP_S, not up to a sampling
        period later. None once a cause is set (the teardown judges nothing)."""
        return self.heartbeats.stop_due() if cause is None else None

    def read_due(self, now: float, cause: RootCause | None) -> bool:
        """A read out of turn: a SIGCHLD came, or a stop is to be shown 3 s long (`stop_due`)."""
        due = self.stop_due(cause)
        return self._read_at == float("-inf") or (due is not None and now >= due and self._read_at < due)

    def verdict(self, now: float, alive: set[int], cause: RootCause | None) -> HangVerdict | None:
        """The judge's verdict on the live ranks, /proc read where due; its notices logged."""
        unwatched = self.heartbeats.newly_unwatched(now, alive)
        if unwatched and self.unwatched_why:
            logger.info(f"rank(s) {', '.join(map(str, unwatched))} sent no heartbeat in their first "
                        f"{self.heartbeats.timeouts.allowance('startup'):g} s: {self.unwatched_why}")
        samples = ()
        if now - self._read_at >= PROC_SAMPLE_S or self.read_due(now, cause):
            self._read_at, samples = now, self.procs.read()
        verdict = self.heartbeats.check(now, alive, samples)
        while self.heartbeats.notices:
            logger.info(self.heartbeats.notices.pop(0))
        return verdict
