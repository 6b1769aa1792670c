"""What the kernel says about each worker process: evidence a hang verdict can rely on.

A rank's own records say where its loop is; they cannot say that the process is
stopped (SIGSTOP, a debugger: state T/t, its liveness thread is frozen too), sleeping
uninterruptibly in the kernel (state D: I/O, a wedged driver), a zombie, or burning CPU
without progress. `/proc/<pid>/stat` (read through psutil) can: the state letter,
since when it has held, and whether CPU time still advances. `ProcReader` reads (the
supervision loop calls it every PROC_SAMPLE_S); `ProcTracker` makes states of the samples
it is given, so the hang verdict is a function of samples a test can write by hand.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
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
PROC_SAMPLE_S = 0.5  # /proc is read this often (and at each SIGCHLD: a worker stopped, continued or exited)


CANNOT_RUN = frozenset("TtD")  # stopped, stopped by a tracer, or asleep in the kernel: handed work, it does none
D_READS, D_READ_GAP_S = 3, 0.05  # a page fault puts a healthy process in D for a moment: D must hold this long


def cannot_run(pid: int) -> str | None:
    """The state letter of a process that cannot run now (T, t, or D held over a few readings
    D_READ_GAP_S apart: a page fault's passing D is no stuck process), else None (it runs,
    sleeps, or is gone: its exit tells the rest)."""
    for reading in range(D_READS):
        try:
            letter = LETTER.get(psutil.Process(pid).status(), "?")
        except psutil.Error:
            return None
        if letter != "D" or reading == D_READS - 1:
            return letter if letter in CANNOT_RUN else None
        time.sleep(D_READ_GAP_S)
    return None


@dataclass(frozen=True)
class ProcState:
    letter: str  # R S D T t Z X I, "?" when unreadable
    since: float  # monotonic time it was first seen in this state
    cpu_busy: float | None  # fraction of one core over the last CPU_WINDOW_S; None: too few samples
    seen: float | None = None  # monotonic time of the latest sample, which still shows it (None: taken as now)

    def held(self, now: float, floor: float = float("-inf")) -> float:
        """Seconds it is known to have held this state: from its first sample in it (or `floor`,
        if later) to its latest, not to `now` (it may have left the state since that sample)."""
        return (now if self.seen is None else self.seen) - max(self.since, floor)

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


@dataclass(frozen=True)
class ProcSample:
    """One reading of one worker's /proc entry: what `ProcReader` gives the hang judge."""

    rank: int
    letter: str  # R S D T t Z X I, "?" when unreadable
    cpu_s: float | None  # user + system CPU seconds so far (None: gone, or not readable)


class ProcReader:
    """Reads each watched worker's /proc entry (through psutil): the only I/O of the kernel's view."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def watch(self, rank: int, pid: int) -> None:
        try:
            self._procs[rank] = psutil.Process(pid)
        except psutil.Error:
            self._procs.pop(rank, None)

    def read(self) -> list[ProcSample]:
        samples = []
        for rank, process in self._procs.items():
            try:
                with process.oneshot():
                    letter = LETTER.get(process.status(), "?")
                    times = process.cpu_times()
                samples.append(ProcSample(rank, letter, times.user + times.system))
            except psutil.ZombieProcess:
                samples.append(ProcSample(rank, "Z", None))
            except psutil.Error:
                samples.append(ProcSample(rank, "X", None))
        return samples


class _Track:
    def __init__(self) -> None:
        self.letter: str | None = None
        self.since = 0.0
        self.seen = 0.0  # the latest sample's time
        self.cpu: deque[tuple[float, float]] = deque()  # (monotonic time, CPU seconds)


def _ran(track: _Track, sample: ProcSample) -> bool:
    """Its CPU time moved on since the previous sample (a stop/continue cycle faster than the samples)."""
    return bool(track.cpu) and sample.cpu_s is not None and sample.cpu_s > track.cpu[-1][1]


class ProcTracker:
    """The samples it is given, per rank: since when each state holds, and how busy the CPU is.
    No I/O: the hang judge's view of the kernel is exactly the samples passed in."""

    def __init__(self) -> None:
        self._tracks: dict[int, _Track] = {}

    def forget(self, rank: int) -> None:
        """`rank` has a new process: its old one's states say nothing about it."""
        self._tracks.pop(rank, None)

    def add(self, samples: Iterable[ProcSample], now: float) -> list[tuple[int, str]]:
        """Takes the samples read at `now`; returns (rank, state letter) of each one that
        entered or left state T (stopped) since its previous sample."""
        changes = []
        for sample in samples:
            track = self._tracks.setdefault(sample.rank, _Track())
            if sample.letter != track.letter:
                if "T" in (sample.letter, track.letter):
                    changes.append((sample.rank, sample.letter))
                track.letter, track.since = sample.letter, now
            elif sample.letter == "T" and _ran(track, sample):
                track.since = now  # stopped at both samples but it ran between them: stopped anew, not since then
            track.seen = now
            if sample.cpu_s is not None:
                track.cpu.append((now, sample.cpu_s))
                while len(track.cpu) > 2 and now - track.cpu[1][0] >= CPU_WINDOW_S:
                    track.cpu.popleft()
        return changes

    def state(self, rank: int) -> ProcState | None:
        track = self._tracks.get(rank)
        if track is None or track.letter is None:
            return None
        busy = None
        if len(track.cpu) >= 2 and track.cpu[-1][0] - track.cpu[0][0] > 0.5:
            (t0, c0), (t1, c1) = track.cpu[0], track.cpu[-1]
            busy = max(0.0, (c1 - c0) / (t1 - t0))
        return ProcState(track.letter, track.since, busy, track.seen)
