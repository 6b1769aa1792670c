"""A straggler moved out live: whether it can be now, its cause, and its evidence on the recovery.

The decision that a rank is due is health/straggler_moves.py's; the move itself is a live
recovery like a hang's (policy.py's `StragglerFound`: SIGKILL, then on its exit a warm spare
takes the rank, or with --min-replicas the group goes on without it), so it costs no restart.
It happens only where it cannot cost more than it saves:

- a warm spare stands by (one still warming up would make the pause longer), and the rank's
  device is not a GPU: a warm spare takes a rank on the rank's own device, so on a GPU it would
  inherit the slow GPU (a spare on another GPU is not built); or
- --min-replicas lets the group go on without it and the rank is slower than a shrink makes
  the job (the survivor that carries its data slot computes two slots a step: `SHRINK_COST`).

Otherwise the rank is named only, with the reason; so is any rank while the group is shrunk (its
carrier computes two slots a step by design: a move-out would only shrink it further). The
recovery it becomes carries the verdict's evidence (`straggler`: compute per step of every rank
before, and after once a window has closed, the job's step time before and after, the seconds
saved so far).
"""

from __future__ import annotations

from typing import Any

from gpuherd.exit_codes import ExitCode
from supervisor.gpus import DeviceSlot
from supervisor.health import Due, Stragglers
from supervisor.processes import policy as pol
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.spawn import WorkerProcess
from supervisor.summary import CauseKind, RootCause

SHRINK_COST = 2.0  # a shrunk group's step: its carrier computes two data slots


def straggler_spare(live: LiveRecovery | None, slot: DeviceSlot, due: Due, survivors: list[int]) -> pol.Spare | None:
    """Can `due`'s rank (on `slot`) be moved out now (None: no live recovery in this attempt)."""
    if live is None:
        return None
    if due.again:
        return pol.Spare(f"rank {due.rank} was moved out once in this attempt already and its replacement is "
                         "slow too: the cause is not in its process (its host? a link?)")
    if live.in_flight is not None:
        return pol.Spare(f"a live recovery is under way (rank {live.in_flight.rank})")
    if live.state.carried:  # the carrier computes two slots: by design, not a straggler
        carried = ", ".join(str(r) for r in sorted(live.state.carried))
        return pol.Spare(f"the group is shrunk (rank(s) {carried} carried by a survivor, which computes more by "
                         "design): compute per step is compared again once it grows back")
    gpu = slot.kind == "cuda"
    why = live.why_not(due.rank, survivors, suspect_gpu=gpu)
    if why is not None:
        if gpu and not live.shrinks(True):
            why = (f"a warm spare takes a rank on the rank's own GPU, {slot.tag}, which would stay as slow (a spare "
                   "on another GPU is not built; --min-replicas lets the group go on without it)")
        return pol.Spare(why)
    if live.shrinks(gpu):
        if due.slowdown <= SHRINK_COST:
            return pol.Spare(f"no warm spare, and a shrink would cost about as much: the rank that carries its data "
                             f"slot computes {SHRINK_COST:g} slots a step, the straggler {due.slowdown:.2f}x one")
        return pol.Spare(None)
    if live.pool.warm() is None:
        return pol.Spare("no warm spare stands by yet (one still warming up would make the move-out's pause longer)")
    return pol.Spare(None)


def straggler_cause(due: Due, w: WorkerProcess, factor: float) -> RootCause:
    """The verdict as the cause of the rank's exit (the recovery's `failed`); never an attempt's
    end on its own: a failed move-out's teardown restarts like any failure."""
    return RootCause(CauseKind.STRAGGLER, ExitCode.FAILURE, due.message(factor), rank=w.slot.rank,
                     device=w.slot.tag)


def moved_out(live: LiveRecovery | None, stragglers: Stragglers | None, rank: int, now: float) -> None:
    """The live recovery just recorded took `rank`: a straggler SIGKILLed to be moved out, its
    evidence goes on the recovery."""
    due = stragglers.moves.pending.pop(rank, None) if stragglers is not None else None
    if live is None or stragglers is None or due is None or not live.recoveries:
        return
    evidence: dict[str, Any] = stragglers.moved(due, now)
    live.recoveries[-1].straggler = evidence
