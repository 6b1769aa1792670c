"""The goodput benchmark's own accounting, independent of gpuherd's (supervisor/goodput):
what each launcher kept, from the steps the training itself logged.

A completion is (time, pid, step, seconds): seconds since the process's previous step or
save ended, None for a process's first step (warm-up). Of every step index the last
completion is kept (the run's final lineage); productive time is the kept completions'
seconds, `redone` the seconds of the completions a later one of the same step replaced,
`checkpoint` the saves' seconds; the rest of the wall time is startup, failure detection,
restarts and stops, which the peers' logs cannot tell apart. A step that took more than
STALL x the median step (a survivor's step across a stop or a live recovery) counts only
STALL x the median: the rest of it was spent waiting, not training.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import orjson

STALL = 3.0


@dataclass(frozen=True)
class Completion:
    time: float
    pid: int
    step: int
    seconds: float | None


@dataclass(frozen=True)
class Kept:
    wall_s: float
    productive_s: float
    redone_s: float
    checkpoint_s: float
    steps_redone: int
    last_step: int | None

    @property
    def ratio(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s else 0.0

    @property
    def rest_s(self) -> float:
        return max(0.0, self.wall_s - self.productive_s - self.redone_s - self.checkpoint_s)


def from_steps_log(path: Path) -> tuple[list[Completion], float]:
    """bench/goodput_worker.py's rank-0 log: (completions, seconds of saves)."""
    completions, saves = [], 0.0
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) != 4:
            continue  # a line cut short by a kill
        if parts[2] == "save":
            saves += float(parts[3])
        else:
            completions.append(Completion(float(parts[0]), int(parts[1]), int(parts[2]),
                                          None if parts[3] == "-" else float(parts[3])))
    return completions, saves


def from_metrics(path: Path) -> list[Completion]:
    """The built-in trainer's rank-0 `step` records (training.log_every=1), each one's seconds since
    the previous record of the same process (its `ready` record's pid)."""
    completions: list[Completion] = []
    pid, last = 0, None
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            r = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(r, dict) or r.get("rank") != 0:
            continue
        if r.get("type") == "ready":
            pid, last = int(r.get("pid") or 0), None
        elif r.get("type") == "step" and "loss" in r:
            completions.append(Completion(r["time"], pid, r["step"], None if last is None else r["time"] - last))
            last = r["time"]
    return completions


def _final(completions: list[Completion]) -> dict[int, Completion]:
    """Of every step index its last completion: the run's final lineage."""
    final: dict[int, Completion] = {}
    for c in sorted(completions, key=lambda c: c.time):
        final[c.step] = c
    return final


def kept(completions: list[Completion], wall_s: float, checkpoint_s: float = 0.0) -> Kept:
    final = _final(completions)
    kept_ids = {id(c) for c in final.values()}
    timed = [c.seconds for c in completions if c.seconds is not None]
    most = STALL * statistics.median(timed) if timed else 0.0

    def worked(cs: list[Completion]) -> float:
        return sum(min(c.seconds, most) for c in cs if c.seconds is not None)

    replaced = [c for c in completions if id(c) not in kept_ids]
    return Kept(wall_s=wall_s, productive_s=worked(list(final.values())), redone_s=worked(replaced),
                checkpoint_s=checkpoint_s, steps_redone=len(replaced), last_step=max(final, default=None))


def fault_cost(completions: list[Completion], at: float) -> float | None:
    """What one fault at wall time `at` cost the run: the seconds from the fault until training
    completed the second step past the furthest one completed before it, less two median steps
    (what those take undisturbed). It holds the detection, the restart or recovery and the steps
    trained again; None when the run never got that far (it ended or was capped).

    Two steps, not one: the step in flight at the fault may still complete at once (the faulted
    rank had already joined its all-reduce), and under live recovery the same process then trains
    on, so that completion says nothing of the fault; the stall shows in the step after it."""
    timed = [c.seconds for c in completions if c.seconds is not None]
    step_s = statistics.median(timed) if timed else 0.0
    before = max((c.step for c in completions if c.time <= at), default=-1)
    # Not the dying attempt's last gasp: the logging rank can still finish the step whose
    # all-reduce the killed rank had joined; that process must have trained on for it to count
    # (a fault in a run's last steps therefore has no cost: the schedule never fires one there).
    furthest: dict[int, int] = {}
    for c in completions:
        furthest[c.pid] = max(furthest.get(c.pid, -1), c.step)
    # the run's final lineage only: a step a dying attempt still completed, then trained again
    # after its restart, is not where the run got past the fault
    after = min((c.time for c in _final(completions).values()
                 if c.time > at and c.step >= before + 2 and furthest[c.pid] > c.step), default=None)
    return None if after is None else max(0.0, after - at - 2 * step_s)

