"""Live recovery carried out on the supervision loop's workers (supervision.py): live_recovery.py
decides whether and how a rank is replaced or grown back; this keeps the loop's view of the
ranks true afterwards: a spare promoted to a rank is that rank's worker from then on, its pipes
and heartbeats read as the rank's.
"""

from __future__ import annotations

from supervisor.health import Heartbeats, ProcReader
from supervisor.output import WorkerPipes
from supervisor.processes import policy as pol
from supervisor.processes.live_recovery import LiveRecovery
from supervisor.processes.spawn import WorkerProcess
from supervisor.processes.straggler_out import moved_out
from supervisor.processes.worker_causes import suspect_gpu
from supervisor.summary import RootCause


class LiveRanks:
    def __init__(self, live: LiveRecovery | None, workers: dict[int, WorkerProcess], heartbeats: Heartbeats,
                 procs: ProcReader, pipes: WorkerPipes) -> None:
        """`workers`: the loop's own rank -> worker map, changed here when a spare takes a rank."""
        self.live = live
        self.workers = workers
        self.heartbeats = heartbeats
        self.procs = procs
        self.pipes = pipes

    def _alive(self) -> list[WorkerProcess]:
        return [w for w in self.workers.values() if w.alive]

    def spare(self, rank: int, suspect: bool = False) -> pol.Spare | None:
        """Can a warm spare take `rank` now, the other live ranks surviving (None: no live recovery)."""
        if self.live is None:
            return None
        return pol.Spare(self.live.why_not(rank, [w.slot.rank for w in self._alive() if w.slot.rank != rank],
                                           suspect_gpu=suspect))

    def replace(self, rank: int, cause: RootCause, now: float) -> bool:
        """Live recovery takes the lost `rank` (live_policy.py decides: a warm spare, or with
        --min-replicas the survivors go on without it); False: it could not (it said why)."""
        lost = self.workers[rank]
        survivors = [o for o in self._alive() if o is not lost]
        recovered, new = (False, None) if self.live is None else \
            self.live.recover(lost, cause, survivors, now, suspect_gpu=suspect_gpu(lost, cause))
        if not recovered:
            return False
        moved_out(self.live, self.heartbeats.stragglers, rank, now)
        if new is not None:
            self.serve(rank, new, now)
        return True

    def regrow(self, rank: int, now: float) -> None:
        """A warm spare serves the carried `rank` from now on (its old process is long gone); the
        group rebuilds with it at its next step boundary."""
        carried = self.workers[rank]
        new = self.live.regrow(carried.slot, carried.log_path, self._alive(), now)
        if new is not None:
            self.serve(rank, new, now)

    def serve(self, rank: int, new: WorkerProcess, now: float) -> None:
        """`new` (a promoted spare) is `rank`'s worker: its pipes and heartbeats are read as the rank's."""
        self.workers[rank] = new
        self.heartbeats.rejoin(rank, now)
        self.procs.watch(rank, new.pid)
        self.pipes.replace(rank, new.popen.stdout, new.popen.stderr, new.status_fd)
