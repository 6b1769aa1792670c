"""Restart standbys: a `--script` run's next attempt starts from interpreters that imported torch
while this one trained.

Most of a script rank's restart is its interpreter importing torch and torch._dynamo (which
DDP's constructor imports): about 2 s of the 2.4 s from a kill to the next step on a 2-core
machine, all of it after the failure. So once an attempt completed its first step, one standby
per local rank is started for the next attempt (only while restarts are left): the script's own
command line through the bootstrap with `GPUHERD_STANDBY=1` (worker/script_bootstrap.py), which
imports them in a thread at nice 19 and then waits on its stdin. Not with the workers: each
standby is a session of its own, and the kernel's autogroups share the CPU by session whatever a
thread's nice value, so standbys importing beside the workers slowed their start by 2 s; nice 19
only keeps the import behind the standby's own main thread. The next attempt hands each standby
its rank's environment as one JSON line and closes the pipe; the process, its pipes and its
status channel then serve as that rank's worker, and the script starts with torch already
imported. End of input instead: the standby is not needed (it exits 0 at once).

A standby is used only where the new attempt's environment differs from the one it started with
in per-attempt variables alone (ATTEMPT_KEYS: the restart count, the store's port, the rank's
error file, ...): anything torch or a library reads at import (OMP_NUM_THREADS changes when the
group shrinks, CUDA_VISIBLE_DEVICES when a GPU is left out) differs, and then that rank starts
afresh, as without standbys. A standby that died meanwhile is replaced by a fresh start too, and
so is one the kernel shows unable to run (stopped: a cgroup freezer, an operator's Ctrl-Z, a
debugger; or stuck in uninterruptible sleep): handed the rank, it would hold the whole attempt
with no first record (a restart to two stopped standbys went silent for the startup allowance,
one stopped standby cost a restart of its own); it is killed and reaped, and said in one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from loguru import logger

from gpuherd import contract
from supervisor.gpus import DeviceSlot
from supervisor.health import MEANING, cannot_run
from supervisor.processes.error_file import ERROR_FILE_VAR
from supervisor.processes.spawn import WorkerProcess

RANK_KEYS = ("RANK", "GROUP_RANK", "ROLE_RANK")  # a standby is no rank until it is promoted
ATTEMPT_KEYS = frozenset({
    contract.STATUS_FD, contract.STANDBY, contract.TRACE_DIR, contract.RESUME, ERROR_FILE_VAR,
    contract.LIVE_RECOVERY, contract.SHRINK, contract.JOIN_GENERATION,  # read by gpuherd.live, after the import
    "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT", "TORCH_FR_DUMP_TEMP_FILE", "TORCHELASTIC_TIMER_FILE",
    # who the rank is: read when the script joins its group, never at torch's import
    *RANK_KEYS, "WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE",
})


def standby_env(worker_env: Mapping[str, str]) -> dict[str, str]:
    """A standby's environment: its local rank's worker environment, marked, without the rank's
    identity (no process that looks for rank N by its environment takes a standby for it)."""
    env = {name: value for name, value in worker_env.items() if name not in RANK_KEYS}
    env[contract.STANDBY] = "1"
    return env


def differences(started_with: Mapping[str, str], wanted: Mapping[str, str]) -> list[str]:
    """The variables, outside ATTEMPT_KEYS, whose values differ (or that only one side has)."""
    names = (set(started_with) | set(wanted)) - ATTEMPT_KEYS
    return sorted(name for name in names if started_with.get(name) != wanted.get(name))


class Standbys:
    """At most one standby per local rank, kept across attempts by the attempt runner."""

    def __init__(self) -> None:
        self._by_local: dict[int, tuple[WorkerProcess, dict[str, str]]] = {}

    def fill(self, slots: list[DeviceSlot], start: Callable[[DeviceSlot], tuple[WorkerProcess, dict[str, str]]]
             ) -> list[WorkerProcess]:
        """A standby for every local rank of `slots` that has no live one; the ones started.
        `start(slot)`: spawn it, and say with which environment."""
        new = []
        for slot in slots:
            held = self._by_local.get(slot.local)
            if held is not None and held[0].poll() is None:
                continue
            process, env = start(slot)
            self._by_local[slot.local] = (process, env)
            new.append(process)
        return new

    def take(self, slot: DeviceSlot, env: Mapping[str, str], log_path) -> WorkerProcess | None:
        """The standby of `slot`'s local rank, promoted to the rank with `env` (its own status fd
        kept), or None: there is none, it died, or `env` differs where torch's import could have
        read it (that standby is ended; the caller starts the rank afresh)."""
        held = self._by_local.pop(slot.local, None)
        if held is None:
            return None
        standby, started_with = held
        if standby.poll() is not None:
            logger.debug(f"restart standby of local rank {slot.local} (pid {standby.pid}) ended with "
                         f"{standby.returncode} before it was needed")
            standby.discard()  # its pipes closed
            return None
        state = cannot_run(standby.pid)
        if state is not None:
            logger.warning(f"restart standby of local rank {slot.local} (pid {standby.pid}) not used: "
                           f"{MEANING[state]} (state {state}); killed, rank {slot.rank} starts afresh")
            standby.discard()
            return None
        changed = differences(started_with, env)
        if changed:
            logger.debug(f"restart standby of local rank {slot.local} not used: {', '.join(changed)} changed")
            standby.discard()
            return None
        assignment = {name: value for name, value in env.items() if name not in (contract.STATUS_FD, contract.STANDBY)}
        try:
            return standby.hand_over(slot, log_path, assignment, started=time.monotonic())
        except OSError as exc:  # it died just now: the rank starts afresh
            logger.debug(f"restart standby pid {standby.pid}: {exc}")
            standby.discard()
            return None

    def lend(self, before: float) -> WorkerProcess | None:
        """The oldest live standby started before `before` (time.monotonic()), out of the set: a
        script's live recovery takes it for a lost rank when its own spare is younger (still
        importing, most likely: the pool's spare started after an earlier recovery). Its local
        rank then restarts afresh, should the attempt fail."""
        alive = [(process.started, local) for local, (process, _) in self._by_local.items()
                 if process.poll() is None and process.started < before]
        for _, local in sorted(alive):
            process = self._by_local.pop(local)[0]
            state = cannot_run(process.pid)
            if state is None:
                return process
            # a stopped or stuck standby would hold the whole rebuilt group: never lent
            logger.warning(f"restart standby of local rank {local} (pid {process.pid}) not lent to a live recovery: "
                           f"{MEANING[state]} (state {state}); killed")
            process.discard()
        return None

    def pids(self) -> set[int]:
        return {process.pid for process, _ in self._by_local.values()}

    def retire(self) -> list[int]:
        """The job's end: every standby told (end of input), given a moment, then killed and
        reaped; their process groups."""
        left = [process for process, _ in self._by_local.values()]
        self._by_local.clear()
        for standby in left:
            standby.discard(wait_s=1.0)  # it leaves at once from its wait
        return [standby.pgid for standby in left]

