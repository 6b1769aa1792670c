"""The accounting: a run's timeline -> productive seconds and badput seconds by cause.

A pure function of the events (timeline.py) and the moment it is asked at. The wall time is
the sum of the supervisor's starts (the first, each SLURM requeue or resubmission), from the
moment it started to `end` (the last start) or its last record (an earlier one); the time a
job waited in the queue between starts belongs to no start. Each start is painted, from the
weakest claim to the strongest (a later paint wins where they overlap):

1. everything is `other`; before the first attempt: `launch` (`restart` for a start that
   continues a run), the dataset cache build's seconds at its end: `dataset`;
2. each attempt, by its leader rank (the lowest that sent records, and while a shrunk group
   trains without it, the lowest that trains: `_leader`): spawn to its first record
   `launch`; phase `rendezvous` -> `rendezvous`; `init` -> `warmup` (`checkpoint_restore`
   when the attempt resumed from a checkpoint); `train` up to the first completed step
   `warmup` (the first step compiles and warms caches); then each interval that ends in a
   completed step (a `step` record) `productive`; phases `checkpoint` -> `checkpoint_save`
   (what the loop was blocked for: an asynchronous save's write is not in it), `eval` ->
   `eval`, `sdc` (replicas found to disagree: naming and healing one, up to the next completed
   step) -> `sdc`; the tail after the leader's last record `other`. A script says nothing before
   its first optimizer step: all of that is `launch`. In an attempt after a failure (or in a
   start that continues a run) launch, rendezvous and warm-up are `restart`;
3. a rank the kernel shows stopped (state T) until it runs again: `stopped`;
4. a live recovery: from the loss to the rebuilt group's first completed step `restart`, and
   the productive time just before the loss that the recovery trained again (its steps
   redone at the attempt's median step time) `redone` (a regrow lost nothing: its pause is
   the leader's `rendezvous` phase of step 2);
5. a failed attempt: from its leader's last record to the moment the supervisor knew
   (`failed_at`: the exit seen, the hang verdict) `failure_detection` (a script that said
   nothing before it failed: none, its exit was seen and its time is `launch`); when the run
   went on (another attempt, another start), from there to the next attempt `restart`, and the
   productive time after the last state kept (the newest checkpoint completed before the
   failure, a script's newest `script_save` as it began; none: the whole attempt) `redone`;
6. a script's attempt ended by a stop (Ctrl-C, SIGTERM): gpuherd saved nothing for it, so the
   productive time after its newest `script_save` (none: the whole attempt) is lost: `redone`.

6. a named straggler (supervisor/health/stragglers.py): what its pace cost the job over its slow
   stretch (its `timeline`/`straggler` record's `lost_s`: the steps' time over what they took
   before it slowed down), the productive time just before the stretch's end `straggler`.

Time trained shrunk (a lost rank's data slot carried by a survivor, --min-replicas: from the
loss to its regrow or the attempt's end) is productive, slower; `Goodput.shrunk_s` says how
much of the wall time it was.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from supervisor.goodput.marks import STOPS
from supervisor.goodput.timeline import Event

PRODUCTIVE = "productive"
CAUSES = ("launch", "dataset", "rendezvous", "warmup", "checkpoint_save", "checkpoint_restore", "eval",
          "failure_detection", "restart", "redone", "sdc", "stopped", "straggler", "other")


@dataclass(frozen=True)
class Goodput:
    ratio: float
    wall_s: float
    productive_s: float
    badput_s: dict[str, float] = field(default_factory=dict)  # every cause, in CAUSES order
    shrunk_s: float = 0.0  # of the wall time: trained with a lost rank's data slot carried (a shrunk group)

    def to_dict(self) -> dict:
        return {"ratio": self.ratio, "wall_s": self.wall_s, "productive_s": self.productive_s,
                "badput_s": dict(self.badput_s), "shrunk_s": self.shrunk_s}


Segment = list  # [t0, t1, label]


def paint(segments: list[Segment], t0: float, t1: float, label: str, only: frozenset[str] | None = None) -> None:
    """Relabel [t0, t1) (only the parts labelled one of `only`, when given), in place."""
    if t1 <= t0:
        return
    out: list[Segment] = []
    for a, b, old in segments:
        if b <= t0 or a >= t1 or old == label or (only is not None and old not in only):
            out.append([a, b, old])
            continue
        if a < t0:
            out.append([a, t0, old])
        out.append([max(a, t0), min(b, t1), label])
        if b > t1:
            out.append([t1, b, old])
    segments[:] = out


def paint_tiles(segments: list[Segment], tiles: list[Segment]) -> None:
    """`paint` each of `tiles` (sorted, none overlapping another: an attempt's loop) in one pass,
    in place. An attempt's loop is a tile per status record, tens of thousands in a long run
    (a script's heartbeats come twice a second): painted one at a time, each would rescan every
    segment, and the run's end (or a restart) would wait minutes on a quadratic."""
    out: list[Segment] = []
    tiles = [t for t in tiles if t[1] > t[0]]
    j = 0
    for a, b, old in segments:
        while j < len(tiles) and tiles[j][1] <= a:
            j += 1
        since, k = a, j  # `old` runs from `since` until a tile with another label
        while k < len(tiles) and tiles[k][0] < b:
            t0, t1, label = max(tiles[k][0], a), min(tiles[k][1], b), tiles[k][2]
            if label != old:
                if t0 > since:
                    out.append([since, t0, old])
                out.append([t0, t1, label])
                since = t1
            if tiles[k][1] > b:  # it goes on into the next segment
                break
            k += 1
        if since < b:
            out.append([since, b, old])
        j = k
    segments[:] = out


def paint_back(segments: list[Segment], end: float, seconds: float, label: str) -> None:
    """Relabel the last `seconds` of productive time before `end` (skipping anything else), in place."""
    for seg in reversed([s for s in segments if s[0] < end and s[2] == PRODUCTIVE]):
        if seconds <= 0:
            return
        a, b = seg[0], min(seg[1], end)
        take = min(seconds, b - a)
        paint(segments, b - take, b, label, only=frozenset({PRODUCTIVE}))
        seconds -= take


def _split(events: list[Event], kind: str) -> list[tuple[Event | None, list[Event]]]:
    """Events grouped by each `kind` marker (the ones before the first marker in a group of None)."""
    groups: list[tuple[Event | None, list[Event]]] = [(None, [])]
    for e in events:
        if e.kind == kind:
            groups.append((e, []))
        else:
            groups[-1][1].append(e)
    return groups


class _Attempt:
    """One attempt's events and what the painting needs to know of them."""

    def __init__(self, mark: Event, events: list[Event], end: float, again: bool) -> None:
        self.begin, self.end, self.again, self.resumed = mark.time, end, again, mark.flag
        self.script = mark.name == "script"  # a --script's: its saves are the `script_save` records
        self.events = events
        ranks = sorted({e.rank for e in events if e.kind in ("phase", "step") and e.rank is not None})
        away = _away(events)
        self.mine = [e for e in events if e.kind in ("phase", "step", "checkpoint") and e.rank is not None
                     and e.rank == _leader(ranks, away, e.time)]
        ended = next((e for e in events if e.kind == "attempt_end"), None)
        self.failed_at = ended.value if ended is not None else None
        self.stopped_by_request = ended is not None and ended.name in STOPS  # Ctrl-C, SIGTERM...: not a failure

    def label(self, cause: str) -> str:
        return "restart" if self.again else cause

    def loop_segments(self) -> tuple[list[Segment], list[float]]:
        """Step 2 of the module docstring, and the step intervals (for the median step)."""
        segs: list[Segment] = []
        steps: list[float] = []
        cur, since, stepped = self.label("launch"), self.begin, False
        for e in self.mine:
            if e.kind == "step":
                # before the first step: warm-up, unless nothing was said before it (a script's
                # first record is its first optimizer step: imports, rendezvous and all are `launch`)
                segs.append([since, e.time, cur if stepped or cur == self.label("launch") else self.label("warmup")])
                if stepped and cur == PRODUCTIVE:
                    steps.append(e.time - since)
                stepped, cur, since = True, PRODUCTIVE, e.time
                continue
            if e.kind == "checkpoint":  # published: a save the loop waited for ends here (the final one)
                if cur == "checkpoint_save":
                    segs.append([since, e.time, cur])
                    cur, since = PRODUCTIVE if stepped else self.label("warmup"), e.time
                continue
            segs.append([since, e.time, cur])
            since = e.time
            cur = {"rendezvous": self.label("rendezvous"), "checkpoint": "checkpoint_save", "eval": "eval",
                   "sdc": "sdc",
                   "shutdown": "other",
                   "init": "checkpoint_restore" if self.resumed else self.label("warmup"),
                   }.get(e.name or "", PRODUCTIVE if stepped else self.label("warmup"))
        # after the leader's last word: no step completed in it (a script that never said one: all launch)
        segs.append([since, self.end, "other" if self.mine or not self.script else cur])
        return segs, steps

    def stopped(self) -> list[tuple[float, float]]:
        """(from, to) of every stretch a rank was in state T (a live recovery replacing the rank
        ends it at the loss)."""
        since: dict[int, float] = {}
        out = []
        for e in self.events:
            if e.kind == "proc" and e.rank is not None and e.name == "T":
                since.setdefault(e.rank, e.time)
            elif e.kind == "proc" and e.rank in since:
                out.append((since.pop(e.rank), e.time))
            elif e.kind == "recovery" and e.rank in since and e.value:
                began = since.pop(e.rank)
                out.append((began, max(began, e.time - e.value)))
        return out + [(t, self.failed_at or self.end) for t in since.values()]

    def progress_before(self, t: float) -> float:
        """The leader's last sign of progress before `t`: a completed step, or a phase it entered
        (not the rendezvous or shutdown that follow a failure)."""
        return max([e.time for e in self.mine if e.time <= t and (e.kind == "step" or e.kind == "phase" and e.name
                    not in ("rendezvous", "shutdown"))], default=self.begin)

    def silent_before(self, t: float) -> bool:
        """A script whose leader said nothing before `t`: imports, rendezvous and all were `launch`."""
        return self.script and not any(e.time <= t for e in self.mine)

    def kept(self, failed: float, any_checkpoint_records: bool) -> float:
        """When the newest state kept before `failed` was taken (the attempt's start: none)."""
        script_saves = [e for e in self.events if e.kind == "script_save" and e.time <= failed]
        if script_saves:  # a script's save the bootstrap (or a framework callback) saw return: as it began
            return max(self.begin, script_saves[-1].time - (script_saves[-1].value or 0.0))
        saved = [e for e in self.events if e.kind == "checkpoint" and e.time <= failed and e.step is not None]
        if saved:
            step = saved[-1].step
            at = [e.time for e in self.mine if e.kind == "step" and e.step == step - 1]
            if at:
                return at[-1]
            starts = [e.time for e in self.mine if e.kind == "phase" and e.name == "checkpoint" and e.time <= saved[-1].time]
            return starts[-1] if starts else self.begin
        if any_checkpoint_records:  # an asynchronous save not completed yet is not kept
            return self.begin
        # a script: its save (torch.save in phase checkpoint) completed when the next phase began
        done = [a.time for a, b in zip(self.mine, self.mine[1:])
                if a.kind == "phase" and a.name == "checkpoint" and b.kind == "phase" and b.time <= failed]
        return done[-1] if done else self.begin


def _away(events: list[Event]) -> dict[int, list[tuple[float, float]]]:
    """rank -> (from, to) of every stretch a shrunk group trained without it: its loss to its
    regrow's first completed step in the rebuilt group (for good if never grown back)."""
    out: dict[int, list[tuple[float, float]]] = {}
    lost: dict[int, float] = {}
    for e in events:
        if e.kind != "recovery" or not e.flag or e.value is None or e.rank is None:
            continue
        if e.name == "shrink":
            lost.setdefault(e.rank, e.time - e.value)
        elif e.name == "regrow" and e.rank in lost:
            out.setdefault(e.rank, []).append((lost.pop(e.rank), e.time))
    for rank, since in lost.items():
        out.setdefault(rank, []).append((since, float("inf")))
    return out


def _leader(ranks: list[int], away: dict[int, list[tuple[float, float]]], t: float) -> int | None:
    """The rank whose records place the loop at `t`: the lowest one training then (a shrink that
    lost rank 0 hands the lead to its lowest survivor; the regrow that brings it back, back)."""
    return next((r for r in ranks if not any(a < t < b for a, b in away.get(r, ()))), None)


def _start(mark: Event, events: list[Event], end: float, continues: bool, more_starts: bool,
           any_checkpoint_records: bool) -> list[Segment]:
    segs: list[Segment] = [[mark.time, end, "other"]]
    groups = [(m, evs) for m, evs in _split(events, "attempt") if m is not None]
    first = groups[0][0].time if groups else end
    paint(segs, mark.time, first, "restart" if continues else "launch")
    if mark.value:
        paint(segs, max(mark.time, first - mark.value), first, "dataset")
    attempts = []
    for i, (m, evs) in enumerate(groups):
        stop = groups[i + 1][0].time if i + 1 < len(groups) else end
        attempts.append(_Attempt(m, evs, stop, again=continues or (m.step or 0) > 0))
    for i, att in enumerate(attempts):
        loop, steps = att.loop_segments()
        paint_tiles(segs, loop)
        for a, b in att.stopped():
            paint(segs, a, b, "stopped")
        median = statistics.median(steps) if steps else 0.0
        for e in att.events:
            if e.kind == "recovery" and e.flag and e.value and e.name != "regrow":
                lost = e.time - e.value
                paint(segs, att.progress_before(lost), lost, "failure_detection")  # a hang's verdict, a kill's exit
                paint(segs, lost, e.time, "restart")
                paint_back(segs, lost, (e.step or 0) * median, "redone")
        for e in att.events:  # after `redone`: the productive time before the steps a recovery redid
            if e.kind == "straggler" and e.value:
                paint_back(segs, e.time, e.value, "straggler")
        failed = att.failed_at
        goes_on = i + 1 < len(attempts) or more_starts
        if failed is None and goes_on and i + 1 == len(attempts):  # a start that ended without a word
            failed = max([e.time for e in att.events], default=att.begin)
            if any(e.kind == "attempt_end" for e in att.events):
                failed = None  # it ended and said how: a stop, whose final save is the state kept
        if att.script and att.stopped_by_request:  # a stop: what the script saved is all it keeps
            paint(segs, att.kept(att.end, any_checkpoint_records), att.end, "redone", only=frozenset({PRODUCTIVE}))
        if failed is None:
            continue
        if not att.silent_before(failed):  # a script silent to its end: its exit was seen, not detected
            paint(segs, att.progress_before(failed), failed, "failure_detection")
        if goes_on:
            paint(segs, failed, att.end, "restart")
            paint(segs, att.kept(failed, any_checkpoint_records), failed, "redone", only=frozenset({PRODUCTIVE}))
    return segs


def painted(events: list[Event], end: float) -> list[Segment]:
    """The run's wall time as [from, to, cause] pieces (`productive` or one of CAUSES), every start's."""
    events = sorted(events, key=lambda e: e.time)
    starts = list(_split(events, "start"))
    if starts[0][0] is None:  # records from before any start mark: the first one starts the run
        head = starts.pop(0)[1]
        if head:
            starts.insert(0, (Event(head[0].time, "start", step=0), head))
    checkpoints = any(e.kind == "checkpoint" for e in events)
    segs: list[Segment] = []
    for i, (mark, evs) in enumerate(starts):
        last = i + 1 == len(starts)
        stop = end if last else min(max([mark.time, *(e.time for e in evs)]), starts[i + 1][0].time)
        segs += _start(mark, evs, stop, continues=i > 0, more_starts=not last, any_checkpoint_records=checkpoints)
    return segs


def shrunk_spans(events: list[Event], end: float) -> list[tuple[float, float]]:
    """(from, to) of every stretch a shrink lasted: its loss to the regrow that took its rank back
    (the decision), else to its attempt's end (or `end`)."""
    out: list[tuple[float, float]] = []
    open_: dict[int | None, float] = {}  # a carried rank -> its loss
    for e in sorted(events, key=lambda e: e.time):
        if e.kind in ("start", "attempt", "attempt_end"):
            out += [(t, e.time) for t in open_.values()]
            open_.clear()
        elif e.kind == "recovery" and e.flag and e.value is not None and e.name == "shrink":
            open_.setdefault(e.rank, e.time - e.value)
        elif e.kind == "recovery" and e.flag and e.value is not None and e.name == "regrow" and e.rank in open_:
            out.append((open_.pop(e.rank), e.time - e.value))
    return out + [(t, end) for t in open_.values()]


def _covered(spans: list[tuple[float, float]], since: float | None, end: float) -> float:
    """Seconds of [since, end] inside any of `spans` (overlaps counted once)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(spans):
        a, b = max(a, reach, since if since is not None else a), min(b, end)
        if b > a:
            total += b - a
        reach = max(reach, b)
    return total


def account(events: list[Event], end: float, since: float | None = None) -> Goodput:
    """Goodput of the run whose events these are, as of `end` (a wall-clock time); `since`:
    only the window [since, end] (the last 5 minutes of `gpuherd top`)."""
    ms = dict.fromkeys((PRODUCTIVE, *CAUSES), 0)
    for a, b, label in painted(events, end):
        a, b = max(a, since) if since is not None else a, min(b, end)
        if b > a:
            ms[label] += round((b - a) * 1000)
    wall = sum(ms.values())
    return Goodput(ratio=round(ms[PRODUCTIVE] / wall, 4) if wall else 0.0, wall_s=wall / 1000,
                   productive_s=ms[PRODUCTIVE] / 1000, badput_s={c: ms[c] / 1000 for c in CAUSES},
                   shrunk_s=round(_covered(shrunk_spans(events, end), since, end), 3))
