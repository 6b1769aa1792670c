"""Which rank hangs the job, by evidence rather than by who went quiet first.

In synchronous training one stuck rank stops every rank: the others wait for it in
the next collective. Silence cannot tell them apart; these rules can, strongest first:

1. the kernel: a process stopped (T/t), in uninterruptible sleep (D), or gone (Z/X);
2. a liveness thread that stopped reporting while the process runs (a wedged process:
   the GIL held by native code, a deadlock in the interpreter);
3. where the loops are: a rank that is *not* in a collective while others wait in one
   is the one they wait for;
4. progress: the rank(s) furthest behind in steps;
5. otherwise (every rank in the same collective, or no liveness at all): the rank
   silent longest, and the verdict says that the evidence does not single one out.

Each rank gets one evidence line; the verdict lists the blamed ranks' lines first.

Before any of that, a verdict needs evidence of *no* progress (`progressing`): a rank past
its allowance whose liveness thread reports it computing (forward/backward, the optimizer
step, data loading, compile), not in a collective, with the kernel saying it runs (state
R or its CPU busy) is slow, not hung: the first step of a large or compiled model takes
minutes. Ranks waiting in a collective for such a rank (at its step or later) are excused
with it (heartbeat.py: up to the startup allowance, never forever). A stopped rank, a
wedged one (its liveness thread silent), one idle in state S with no CPU, or one blocked in
a collective the computing ranks already left still hang.

Some evidence needs no allowance at all (`decisive`): while another rank still runs, a rank
the kernel shows stopped by a signal (state T) for DECISIVE_STOP_S, or one whose liveness
thread has been silent for DECISIVE_SILENT_S while its process sleeps with an idle CPU,
outside a save or a startup phase (by its liveness thread's last word or its loop's own
announcement, whichever is newer: a loop that holds the GIL from the moment it announced a
save leaves its thread no chance to say so), and every other rank waits in a collective for it. None
of the slow-but-alive cases looks like that: a GC pause, a long first step or a compile keep
the CPU busy, a long eval or a slow save keep the liveness thread reporting (and a save is
excluded outright), a debugger's brief look is state t, not T; every rank stopped at once
is a pause someone made (Ctrl-Z), judged by the allowances as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuherd.status_records import Alive
from supervisor.health.proc_state import BUSY_FRACTION, ProcState

COMPUTING = ("forward/backward", "optimizer step", "data loading")  # `where` values that are work
LIVENESS_SILENT_S = 5.0  # no `alive` record for this long (they come every second): the thread is frozen
DECISIVE_STOP_S = 3.0  # in state T this long: stopped, not a stop-and-continue in passing
DECISIVE_SILENT_S = 3.0  # `alive` records come every second: three missed, with the CPU idle, is no GC pause
NOT_DECISIVE_PHASES = ("checkpoint", "init", "rendezvous", "compile", "shutdown")  # a save, or startup's own pace

HARD, SILENT, ELSEWHERE, BEHIND, WAITING = 4, 3, 2, 1, 0  # evidence levels, strongest first


@dataclass(frozen=True)
class RankSnapshot:
    """What the heartbeat monitor knows of one rank when the verdict is made."""

    rank: int
    step: int | None  # the furthest step any of its records reported
    silent_s: float  # since its last record of any kind
    live: Alive | None  # its last `alive` record (None: it sends none)
    live_age_s: float | None  # since that record
    live_latest: bool  # that record is its newest record (its `where` is not stale)
    proc: ProcState | None
    # the phase its loop last announced (a `phase` record, sent by the loop itself): fresher than
    # the `alive` record when the loop entered a save or a compile and blocked before its
    # liveness thread reported again
    announced: str | None = None


@dataclass(frozen=True)
class Evidence:
    rank: int
    level: int
    waiting: bool
    step: int | None
    line: str


def _last_seen(v: RankSnapshot) -> str:
    """Where its records last placed it: `step 27, forward/backward`."""
    live = v.live
    at = f"step {v.step}" if v.step is not None else (live.phase if live is not None else "startup")
    if v.live_latest and live is not None and live.where:
        return f"{at}, {'in ' if live.collective else ''}{live.where}"
    return at


def judge(v: RankSnapshot, now: float) -> Evidence:
    """One rank's evidence line and level."""
    proc = "" if v.proc is None else v.proc.describe(now)
    if v.live is None:  # a script without liveness records: silence, steps and the kernel only
        head = f"rank {v.rank} sent no heartbeat for {v.silent_s:.0f} s" if v.silent_s >= 1 else \
            f"rank {v.rank}: last record {v.silent_s:.0f} s ago"
        detail = f"step {v.step if v.step is not None else '-'}" + (f"; {proc}" if proc else "")
        level = HARD if v.proc is not None and v.proc.hard else BEHIND
        return Evidence(v.rank, level, False, v.step, f"{head} ({detail})")
    live = v.live
    step = live.step
    if v.proc is not None and v.proc.hard:
        return Evidence(v.rank, HARD, False, step, f"rank {v.rank}: {proc}; last seen at {_last_seen(v)}")
    if v.live_age_s is not None and v.live_age_s > LIVENESS_SILENT_S:
        return Evidence(v.rank, SILENT, False, step,
                        f"rank {v.rank}: no liveness record for {v.live_age_s:.0f} s although the process runs "
                        f"({proc or 'state unknown'}): wedged; last seen at {_last_seen(v)}")
    suffix = f" ({proc})" if proc else ""
    there = f"{live.where_s + (v.live_age_s or 0):.0f} s"
    at = f"at step {step}" if step is not None else f"in {live.phase}"
    if live.collective:
        return Evidence(v.rank, WAITING, True, step, f"rank {v.rank}: waiting in {live.where} {at} for {there}"
                                                     f"{suffix}")
    return Evidence(v.rank, ELSEWHERE, False, step,
                    f"rank {v.rank}: in {live.where} {at} for {there}, not in a collective{suffix}")


def computing(v: RankSnapshot) -> str | None:
    """How `v` shows it is working (one line), or None when nothing says so."""
    live, proc = v.live, v.proc
    if live is None or proc is None or proc.hard or v.live_age_s is None or v.live_age_s > LIVENESS_SILENT_S:
        return None
    if live.collective or not (live.where in COMPUTING or live.phase == "compile"):
        return None
    if proc.letter != "R" and (proc.cpu_busy is None or proc.cpu_busy < BUSY_FRACTION):
        return None
    doing = live.where or live.phase
    at = f"step {live.step}" if live.step is not None else live.phase
    return f"rank {v.rank}: {doing} at {at} for {live.where_s + v.live_age_s:.0f} s, {proc.describe(0.0)}"


def progressing(views: list[RankSnapshot]) -> dict[int, str]:
    """The ranks that are not hung although past their allowance: those computing, and those
    waiting in a collective for them (at the computing ranks' step or later). rank -> why."""
    busy = {v.rank: line for v in views if (line := computing(v)) is not None}
    if not busy:
        return {}
    slowest = min((_step(v) for v in views if v.rank in busy), default=0)
    waiting = {v.rank: f"rank {v.rank}: waiting in {v.live.where} for the computing rank(s)"
               for v in views if v.rank not in busy and v.live is not None and v.live.collective
               and v.live_age_s is not None and v.live_age_s <= LIVENESS_SILENT_S and _step(v) >= slowest}
    return busy | waiting


def _step(v: RankSnapshot) -> int:
    step = v.live.step if v.live is not None else v.step
    return step if isinstance(step, int) else -1


def decisive(views: list[RankSnapshot], now: float, floor: float) -> tuple[list[int], str]:
    """(ranks hung beyond doubt, why) by the rules of the module docstring's last paragraph;
    `floor`: no state counts from before this moment (the supervisor itself was stopped)."""
    in_t = [v for v in views if v.proc is not None and v.proc.letter == "T"]
    stopped = [v.rank for v in in_t if v.proc.held(now, floor) >= DECISIVE_STOP_S]
    # a rank seen in T for less time is stopped too, not running: the whole job may be stopping
    # (Ctrl-Z reaches the ranks one by one, and /proc may show them in two reads)
    if stopped and len(in_t) < len(views):
        return stopped, f"stopped by a signal (state T) for {DECISIVE_STOP_S:g} s or more while the others run"
    for v in views:
        others = [o for o in views if o.rank != v.rank]
        if others and _wedged(v, now, floor) and all(_waiting(o) for o in others):
            return [v.rank], (f"its liveness thread silent for {DECISIVE_SILENT_S:g} s or more, its CPU idle, "
                              "while every other rank waits for it in a collective")
    return [], ""


def _wedged(v: RankSnapshot, now: float, floor: float) -> bool:
    if v.live is None or v.live_age_s is None or v.proc is None:
        return False
    silent_since = max(now - v.live_age_s, floor)
    return (now - silent_since >= DECISIVE_SILENT_S and v.proc.letter == "S" and v.proc.cpu_busy is not None
            and v.proc.cpu_busy < BUSY_FRACTION and v.live.phase not in NOT_DECISIVE_PHASES
            and v.announced not in NOT_DECISIVE_PHASES)


def _waiting(v: RankSnapshot) -> bool:
    return (v.live is not None and v.live.collective and v.live_age_s is not None
            and v.live_age_s <= LIVENESS_SILENT_S)


def blame(evidence: list[Evidence], stalled: dict[int, float]) -> tuple[list[int], str]:
    """(blamed ranks, why) by the rules of the module docstring."""
    for level, why in ((HARD, "the kernel shows it cannot run"), (SILENT, "its liveness thread went silent")):
        hits = [e.rank for e in evidence if e.level == level]
        if hits:
            return hits, why
    waiting = [e for e in evidence if e.waiting]
    elsewhere = [e for e in evidence if not e.waiting]
    if waiting and elsewhere:
        return [e.rank for e in elsewhere], "not in the collective the others wait in"
    steps = [e.step for e in evidence if isinstance(e.step, int)]
    if steps and min(steps) < max(steps):
        return [e.rank for e in evidence if e.step == min(steps)], "furthest behind in steps"
    longest = max(stalled, key=stalled.get)
    if waiting:
        return [longest], ("every rank waits in a collective at the same step: mismatched collectives or "
                           "the network/NCCL, no rank stands out; see the collective traces")
    return [longest], "stuck the longest; the evidence does not single out a rank"


def ordered_lines(evidence: list[Evidence], blamed: list[int]) -> list[str]:
    first = [e.line for e in evidence if e.rank in blamed]
    return first + [e.line for e in evidence if e.rank not in blamed]
