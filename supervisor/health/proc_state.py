"""What the kernel says about each worker process: evidence a hang verdict can rely on.

A rank's own records say where its loop is; they cannot say that the process is
stopped (SIGSTOP, a debugger: state T/t, its liveness thread is frozen too), sleeping
uninterruptibly in the kernel (state D: I/O, a wedged driver), a zombie, or burning CPU
without progress. `/proc/<pid>/stat` (read through psutil) can: the state letter,
since when it has held, and whether CPU time still advances.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import psutil

# psutil's names -> the letter `ps` and /proc/<pid>/stat show, which users search for
LETTER = {
    psutil.STATUS_RUNNING: "R", psutil.STATUS_SLEEPING: "S", psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_DEAD: "X", psutil.STATUS_IDLE: "I",
}
MEANING = {"T": "process stopped", "t": "process stopped by a tracer", "D": "uninterruptible sleep in the kernel",
           "Z": "process exited (zombie)", "X": "process dead"}
HARD_STATES = frozenset(MEANING)  # states that alone explain a hang
FROZEN_STATES = frozenset("TtZX")
CPU_WINDOW_S = 3.0  # CPU time is judged over about this long
BUSY_FRACTION = 0.05  # of one core: below this the process counts as idle


@dataclass(frozen=True)
class ProcState:
    letter: str  # R S D T t Z X I, "?" when unreadable
    since: float  # monotonic time it was first seen in this state
    cpu_busy: float | None  # fraction of one core over the last CPU_WINDOW_S; None: too few samples

    @property
    def hard(self) -> bool:
        return self.letter in HARD_STATES

    @property
    def frozen(self) -> bool:
        """No thread of it runs (stopped or gone); in D only the sleeping thread waits."""
        return self.letter in FROZEN_STATES

    def describe(self, now: float) -> str:
        """e.g. `process stopped (state T) for 12 s` or `state S, CPU idle`."""
        if self.hard:
            return f"{MEANING[self.letter]} (state {self.letter}) for {now - self.since:.0f} s"
        cpu = "" if self.cpu_busy is None else (
            f", CPU busy ({100 * self.cpu_busy:.0f}% of a core)" if self.cpu_busy >= BUSY_FRACTION else ", CPU idle")
        return f"state {self.letter}{cpu}"


class _Proc:
    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.letter: str | None = None
        self.since = 0.0
        self.cpu: deque[tuple[float, float]] = deque()  # (monotonic time, CPU seconds)


class ProcWatch:
    """Samples each worker's /proc entry; `state(rank, now)` answers from the latest sample."""

    def __init__(self) -> None:
        self._procs: dict[int, _Proc] = {}

    def watch(self, rank: int, pid: int) -> None:
        try:
            self._procs[rank] = _Proc(pid)
        except psutil.Error:
            self._procs.pop(rank, None)

    def sample(self, now: float) -> list[tuple[int, str]]:
        """Reads every watched process; returns (rank, state letter) of each one that entered or
        left state T (stopped) since the last sample."""
        changes = []
        for rank, proc in self._procs.items():
            try:
                with proc.process.oneshot():
                    letter = LETTER.get(proc.process.status(), "?")
                    times = proc.process.cpu_times()
            except psutil.ZombieProcess:
                letter, times = "Z", None
            except psutil.Error:
                letter, times = "X", None
            if letter != proc.letter:
                if "T" in (letter, proc.letter):
                    changes.append((rank, letter))
                proc.letter, proc.since = letter, now
            if times is not None:
                proc.cpu.append((now, times.user + times.system))
                while len(proc.cpu) > 2 and now - proc.cpu[1][0] >= CPU_WINDOW_S:
                    proc.cpu.popleft()
        return changes

    def state(self, rank: int) -> ProcState | None:
        proc = self._procs.get(rank)
        if proc is None or proc.letter is None:
            return None
        busy = None
        if len(proc.cpu) >= 2 and proc.cpu[-1][0] - proc.cpu[0][0] > 0.5:
            (t0, c0), (t1, c1) = proc.cpu[0], proc.cpu[-1]
            busy = max(0.0, (c1 - c0) / (t1 - t0))
        return ProcState(proc.letter, proc.since, busy)
