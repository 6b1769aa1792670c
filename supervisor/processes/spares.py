"""Warm spare workers (--spares K): started with an attempt's workers, handed a lost rank.

K is the pool's size at every moment, not a budget: a spare that takes a rank is replaced at
once by a new one (`fill`), which warms up while the job trains, at a low priority
(worker/spare.py), and stands ready for the next failure.

A spare is `python -m worker` with GPUHERD_SPARE=1 (worker/spare.py): it imports torch and
the trainer and opens the dataset cache, then waits on its stdin. Promotion writes the lost
rank's environment there as one JSON line and closes the pipe; the process, its pipes and
its status channel then serve as that rank's worker. Its own output before promotion stays
in its pipes (a spare prints nothing while it waits) and is read as the rank's; its status
channel carries one record before then, `live`/`warm` at the end of its warm-up, which the
pool reads itself (`warm`): a regrow takes only a spare that said it, and so does a straggler's
move-out. A script's spare (its interpreter waiting in the bootstrap, live_setup.py) says it
too, once its import of torch is over (worker/script_bootstrap.py's `WarmWord`).
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Mapping

from loguru import logger

from gpuherd import contract
from gpuherd.status_records import LiveWarm, decode
from supervisor.gpus import DeviceSlot
from supervisor.processes.spawn import WorkerProcess
from supervisor.summary import how_it_ended


class SparePool:
    def __init__(self, count: int, start: Callable[[int], WorkerProcess],
                 lend: Callable[[float], WorkerProcess | None] | None = None) -> None:
        """`start(n)`: spawn spare number n (a WorkerProcess whose slot is only a placeholder);
        `lend(before)`: a process of the same kind started before `before`, taken instead of a
        younger spare (a script's restart standbys: supervisor/processes/standbys.py)."""
        self.count, self._start, self._lend = count, start, lend
        self.spares: list[WorkerProcess] = []
        self.started = 0
        self._warm: set[int] = set()  # pids of the spares whose warm-up ended

    def fill(self) -> list[WorkerProcess]:
        """Start spares until `count` are waiting; the ones started."""
        new = []
        while len([s for s in self.spares if s.poll() is None]) < self.count:
            new.append(self.add())
        return new

    def add(self) -> WorkerProcess:
        """Start one spare more, whatever `count` says (one an operator asked for: `gpuherd spare`)."""
        spare = self._start(self.started)
        self.spares.append(spare)
        self.started += 1
        return spare

    def ready(self) -> bool:
        """A live spare waits (without taking it)."""
        return any(s.poll() is None for s in self.spares)

    def warm(self) -> WorkerProcess | None:
        """A live spare whose warm-up ended (without taking it), or None."""
        for spare in self.spares:
            if spare.poll() is None and (spare.pid in self._warm or self._heard_warm(spare)):
                return spare
        return None

    def _heard_warm(self, spare: WorkerProcess) -> bool:
        """Read what the spare said on its status channel (nothing blocks: a select first)."""
        try:
            if not select.select([spare.status_fd], [], [], 0)[0]:
                return False
            said = os.read(spare.status_fd, 65536)
        except OSError:
            return False
        if any(isinstance(decode(line), LiveWarm) for line in said.splitlines()):
            self._warm.add(spare.pid)
        return spare.pid in self._warm

    def take_warm(self) -> WorkerProcess | None:
        """The warm spare `warm` names, out of the pool."""
        spare = self.warm()
        if spare is not None:
            self.spares.remove(spare)
        return spare

    def take(self) -> tuple[WorkerProcess | None, str]:
        """A live spare (or an older process `lend` gives: it had longer to warm up), or None and
        why there is none."""
        if self._lend is not None:
            oldest_spare = min((s.started for s in self.spares if s.poll() is None), default=float("inf"))
            older = self._lend(oldest_spare)
            if older is not None:
                return older, ""
        gone = []
        for spare in list(self.spares):
            self.spares.remove(spare)
            if spare.poll() is None:
                return spare, ""
            gone.append(f"pid {spare.pid} {how_it_ended(spare.returncode)}")
        if gone:
            return None, f"the warm spare is gone ({'; '.join(gone)})"
        return None, "no warm spare left (--spares)"

    def put_back(self, spare: WorkerProcess) -> None:
        """A spare taken for a recovery that could not go ahead waits again (first in line)."""
        self.spares.insert(0, spare)

    def promote(self, spare: WorkerProcess, slot: DeviceSlot, log_path, env: Mapping[str, str]) -> WorkerProcess:
        """Hand `spare` the rank of `slot`: its environment (but its own status fd) on stdin. Its
        `warm` record, if it came, is read here: the rank's channel starts with the rank's records."""
        self._heard_warm(spare)
        self._warm.discard(spare.pid)
        assignment = {name: value for name, value in env.items() if name not in (contract.STATUS_FD, contract.SPARE)}
        return spare.hand_over(slot, log_path, assignment, started=spare.started)

    def retire(self) -> list[WorkerProcess]:
        """End of the attempt: spares never used are told (end of input) and handed back to be killed."""
        left, self.spares = self.spares, []
        for spare in left:
            try:
                spare.popen.stdin.close()
            except OSError as exc:
                logger.debug(f"spare pid {spare.pid}: {exc}")
        return left
