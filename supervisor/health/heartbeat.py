"""Status records -> per-rank liveness: hangs, early exits, a process group that never forms.

Any status record is a heartbeat. Until a rank's first `step`, and while it is in
a slow phase (compile, checkpoint, eval), it gets the longer startup allowance;
in training it gets `hang_timeout`, unless another rank is saving a checkpoint
(ranks waiting in a collective for the saver get the saver's allowance). Ranks that
never write a record (a script that steps no torch optimizer, or runs with
`--no-auto-heartbeat` and no status records) are not judged by heartbeat unless the
run expects heartbeats (built-in workers always send them); the supervisor is told
once (`newly_unwatched`) so it can say so. Among stale ranks the straggler is a rank
whose process is stopped (SIGSTOP, a debugger) if any, else the one furthest behind.

Silence counts only while the supervisor itself runs: after it was stopped (Ctrl-Z,
SIGSTOP, a frozen VM) the clocks restart from the moment it resumed
(`restart_clocks`), so heartbeats that sat unread in the pipes meanwhile never make
a healthy worker look hung.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# shutdown: the program is done and the interpreter tears down (process groups, CUDA, a big
# model's garbage), which can take longer than a training step
SLOW_PHASES = {"init", "rendezvous", "compile", "checkpoint", "eval", "shutdown"}
# Defaults when system.hang_timeout is 0: a production step plus its logging can take
# minutes on one GPU; a --script's steps are unknown, so be generous.
HANG_DEFAULTS = {"debug": 60.0, "gpt2-small": 300.0, "production": 600.0}
SCRIPT_HANG_DEFAULT = 300.0


def hang_timeouts(preset: str, hang_timeout: float, startup_timeout: float, script: bool) -> tuple[float, float]:
    """(hang, startup) seconds for this run."""
    hang = hang_timeout or (SCRIPT_HANG_DEFAULT if script else HANG_DEFAULTS.get(preset, 600.0))
    startup = startup_timeout or max(3 * hang, 300.0)
    return hang, startup


@dataclass
class RankState:
    rank: int
    spawned: float
    last_record: float | None = None
    records: int = 0
    phase: str | None = None
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    done: bool = False
    joined: bool = False  # past process-group init (any record that only a joined rank sends)
    error: str | None = None
    unwatched_told: bool = False  # the supervisor said this rank is not judged by heartbeat
    saving: bool = False  # in phase checkpoint, its `checkpoint` record not sent yet
    save_ended: float | None = None  # when its last save ended (record or next phase)
    saved_at: float | None = None  # when its last `checkpoint` record came

    def describe(self) -> str:
        if self.records == 0:
            return "never sent a status record"
        parts = [f"step {self.step}" if self.step is not None else "no step yet"]
        if self.phase:
            parts.append(f"phase {self.phase}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Verdict:
    kind: str  # "hang" | "rendezvous"
    rank: int  # the straggler
    message: str


class Heartbeats:
    def __init__(self, ranks: list[int], now: float, hang: float, startup: float, rendezvous: float,
                 expect_heartbeats: bool) -> None:
        self.ranks = {r: RankState(r, now) for r in ranks}
        self.hang, self.startup, self.rendezvous = hang, startup, rendezvous
        self.expect = expect_heartbeats
        self._rendezvous_started: float | None = None
        self._clock_floor = now  # no silence counts from before this (restart_clocks)

    def record(self, rank: int, rec: dict[str, Any], now: float) -> None:
        st = self.ranks.get(rank)
        if st is None:
            return
        st.last_record, st.records = now, st.records + 1
        kind = rec.get("type")
        if st.phase == "rendezvous":  # anything a rank says after entering rendezvous means it got through
            st.joined = True
        if kind in ("phase", "checkpoint"):
            self._track_save(st, rec, now)
        if kind == "phase":
            st.phase = str(rec.get("name"))
            if st.phase == "rendezvous":
                st.joined = False
                if self._rendezvous_started is None:
                    self._rendezvous_started = now
        elif kind == "step":
            st.step, st.max_steps, st.loss = rec.get("step"), rec.get("max_steps"), rec.get("loss")
            st.joined = True
            if st.phase in ("init", "rendezvous", None):
                st.phase = "train"
        elif kind in ("eval", "checkpoint", "nan"):
            st.joined = True
            if rec.get("step") is not None:
                st.step = rec["step"]
        elif kind == "done":
            st.done = st.joined = True
            if rec.get("step") is not None:
                st.step = rec["step"]
        elif kind == "error":
            st.error = str(rec.get("message"))

    @staticmethod
    def _track_save(st: RankState, rec: dict[str, Any], now: float) -> None:
        starts = rec.get("type") == "phase" and rec.get("name") == "checkpoint"
        if st.saving and not starts:
            st.saving, st.save_ended = False, now
        if starts:
            st.saving = True
        if rec.get("type") == "checkpoint":
            st.saved_at = now

    def restart_clocks(self, now: float) -> None:
        """The supervisor was not running until `now`: start every silence from here."""
        self._clock_floor = max(self._clock_floor, now)

    def _since(self, st: RankState) -> float:
        return max(st.last_record or st.spawned, self._clock_floor)

    def allowance(self, st: RankState, saving: bool = False) -> float:
        """`saving`: another rank is in phase checkpoint (this one may be waiting for it)."""
        if st.step is None or st.phase in SLOW_PHASES or saving:
            return self.startup
        return self.hang

    def check(self, now: float, alive: set[int], stopped: Callable[[], set[int]] | None = None) -> Verdict | None:
        """A hang or a failed rendezvous among the ranks still running, or None. `stopped()`:
        the ranks whose process is stopped, asked only once some rank is stale."""
        watched = [st for r, st in self.ranks.items()
                   if r in alive and not st.done and (self.expect or st.records)]
        started = self._rendezvous_started
        if started is not None and now - max(started, self._clock_floor) > self.rendezvous:
            missing = [st for st in self.ranks.values() if st.rank in alive and not st.joined]
            if missing:
                names = ", ".join(f"rank {st.rank} ({st.describe()})" for st in missing)
                return Verdict("rendezvous", missing[0].rank,
                               f"process group not formed after {self.rendezvous:.0f} s: {names} never joined")
        saving = any(st.phase == "checkpoint" for st in watched)
        stale = [st for st in watched if now - self._since(st) > self.allowance(st, saving)]
        if not stale:
            return None
        paused = sorted((stopped() if stopped is not None else set()) & alive)
        # The straggler: a stopped process if any, else the rank furthest behind, then the one silent longest.
        straggler = min([self.ranks[r] for r in paused] or stale,
                        key=lambda st: (st.step if st.step is not None else -1, st.last_record or st.spawned))
        silent = now - self._since(straggler)
        evidence = "; its process is stopped (SIGSTOP or a debugger)" if straggler.rank in paused else ""
        return Verdict("hang", straggler.rank,
                       f"rank {straggler.rank} sent no heartbeat for {silent:.0f} s "
                       f"(allowance {self.allowance(straggler, saving):.0f} s; {straggler.describe()}{evidence}); "
                       f"steps reached: {self.steps_reached()}")

    def newly_unwatched(self, now: float, alive: set[int]) -> list[int]:
        """Ranks still running past the startup allowance without a single record, each
        returned once: nothing judges them by heartbeat, and the user should know."""
        if self.expect:
            return []
        due = [st for st in self.ranks.values() if st.rank in alive and not st.records and not st.unwatched_told
               and now - st.spawned > self.startup]
        for st in due:
            st.unwatched_told = True
        return [st.rank for st in due]

    def steps_reached(self) -> str:
        return ", ".join(f"rank {st.rank}={st.step if st.step is not None else '-'}" for st in self.ranks.values())

