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
too, once its import of torch is over (worker/script_bootstrap.py's `WarmWord`); a spare forked
from the source says it at once.

Where the supervisor is a child subreaper (`source`), the pool starts one spare source instead
(supervisor/processes/spare_source.py, worker/spare_fork.py): a spare that warms up once (a
script's interpreter importing torch; the built-in's imports, dataset and rehearsal) and then
forks the K spares, and each refill, warm at once and for a few ms of CPU. The source is one process more
than K; it is itself taken for a lost rank only where no spare it forked is there yet (a loss
during its import), and the next refill starts a new one.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Mapping

from loguru import logger

from gpuherd import contract
from gpuherd.status_records import LiveWarm, decode
from supervisor.gpus import DeviceSlot
from supervisor.processes.spare_source import SpareSource
from supervisor.processes.spawn import WorkerProcess
from supervisor.summary import how_it_ended


class SparePool:
    def __init__(self, count: int, start: Callable[[int, Mapping[str, str]], WorkerProcess],
                 lend: Callable[[float], WorkerProcess | None] | None = None,
                 source: Callable[[int, Mapping[str, str]], SpareSource] | None = None) -> None:
        """`start(n, env)`: spawn spare number n (a WorkerProcess whose slot is only a placeholder)
        with `env` added to its environment; `lend(before)`: a process of the same kind started
        before `before`, taken instead of a younger spare (a script's restart standbys:
        supervisor/processes/standbys.py); `source(n, env)`: spawn a spare source as spare number
        n, of which the spares are then asked."""
        self.count, self._start, self._lend, self._new_source = count, start, lend, source
        self.spares: list[WorkerProcess] = []
        self.started = 0
        self._warm: set[int] = set()  # pids of the spares whose warm-up ended (a fork of the source: at birth)
        self.source: SpareSource | None = None
        self.asked = 0  # spares asked of a source so far

    def fill(self, awaited: bool = False) -> list[WorkerProcess]:
        """Start spares until `count` are waiting (or, with a source, asked of it); the ones started.
        `awaited`: a shrunk group waits for one, so a spare started now warms up at the ranks'
        priority, not at nice 19 (worker/spare.py: `warm_up_nice`); a fork of a warm source needs
        no warm-up either way."""
        env = _warm_up_env(awaited)
        self.adopt()
        new = self._fill_source(env) if self._new_source is not None and self.count > 0 else []
        while len([s for s in self.spares if s.poll() is None]) + self._asked() < self.count:
            if self.source is not None and self.source.ask(self.started):
                self.started += 1
                self.asked += 1
                continue
            new.append(self.add(awaited))
        return new

    def _fill_source(self, env: Mapping[str, str]) -> list[WorkerProcess]:
        """A live source, started where there is none (its predecessor ended or took a rank)."""
        if self.source is not None and self.source.process.poll() is None:
            return []
        if self.source is not None:
            self.source.close()
            self.source.process.discard()
        self.source = self._new_source(self.started, env)
        self.started += 1
        return [self.source.process]

    def _asked(self) -> int:
        return len(self.source.asked) if self.source is not None else 0

    def adopt(self) -> list[WorkerProcess]:
        """The spares the source forked since the last look, into the pool (warm: a fork of a warm
        interpreter); nothing blocks."""
        if self.source is None:
            return []
        forked, failed = self.source.collect(self.source.process.slot)
        for spare in forked:
            self.spares.append(spare)
            self._warm.add(spare.pid)
        if forked:
            logger.debug(f"warm spare(s) pid {', '.join(str(s.pid) for s in forked)} forked by the spare source pid "
                        f"{self.source.process.pid} (a copy of its warm interpreter: no import of their own)")
        if failed:
            logger.debug(f"{failed} spare(s) asked of the spare source pid {self.source.process.pid} not forked")
        return forked

    def add(self, awaited: bool = False) -> WorkerProcess:
        """Start one spare more, whatever `count` says (one an operator asked for: `gpuherd spare`);
        `awaited`: as for `fill`."""
        spare = self._start(self.started, _warm_up_env(awaited))
        self.spares.append(spare)
        self.started += 1
        return spare

    def ready(self) -> bool:
        """A live spare (or source) waits (without taking it)."""
        return any(s.poll() is None for s in self.spares) or self._source_alive()

    def _source_alive(self) -> bool:
        return self.source is not None and self.source.process.poll() is None

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
        """A live spare: one the source forked (warm), else an older process `lend` gives (it had
        longer to warm up), else a spare or the source itself (still importing); or None and why
        there is none."""
        if self.source is not None:
            self.adopt()
            forked = self.take_warm()
            if forked is not None:
                return forked, ""
        if self._lend is not None:
            oldest_spare = min((s.started for s in self._waiting()), default=float("inf"))
            older = self._lend(oldest_spare)
            if older is not None:
                return older, ""
        gone = []
        for spare in list(self.spares):
            self.spares.remove(spare)
            if spare.poll() is None:
                return spare, ""
            gone.append(f"pid {spare.pid} {how_it_ended(spare.returncode)}")
        if self._source_alive():  # no fork of it yet: it takes the rank, and serves no more spares
            source, self.source = self.source, None
            source.close()
            return source.process, ""
        if gone:
            return None, f"the warm spare is gone ({'; '.join(gone)})"
        return None, "no warm spare left (--spares)"

    def _waiting(self) -> list[WorkerProcess]:
        return [s for s in self.spares if s.poll() is None] + ([self.source.process] if self._source_alive() else [])

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
        if self.source is not None:
            self.source.close()
            left.append(self.source.process)
            self.source = None
        for spare in left:
            try:
                spare.popen.stdin.close()
            except OSError as exc:
                logger.debug(f"spare pid {spare.pid}: {exc}")
        return left


def _warm_up_env(awaited: bool) -> dict[str, str]:
    """What a new spare's environment says of its warm-up's priority (worker/spare.py)."""
    return {contract.SPARE_WARM_UP_NICE: "0"} if awaited else {}
