"""How a run stops when it is asked to, rather than when something fails
(docs/reference/signals.md).

Ctrl-C (SIGINT) and a stop request (SIGTERM or SIGHUP: `scancel`, a preemption;
SIGUSR1/SIGUSR2: SLURM's `--signal=USR1@T` warning before the time limit) both let
the workers finish their step and save a checkpoint. Ctrl-C gives them the grace
period, extended while one of them is saving; a stop request gives them the whole
stop timeout. Neither lets a save run past the stop timeout. gpuherd's own worker
takes SIGUSR2 as "save and stop" (exit 143); it takes any stop signal it receives itself
(SLURM signals every process of a step) the same way, so the supervisor tears it down with
gpuherd/contract.TEARDOWN_SIGNAL and asks for stacks with STACKS_SIGNAL, signals nobody
else sends. A --script gets SIGTERM, as under torchrun, and the stop timeout to act on it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace

from gpuherd import contract
from gpuherd.exit_codes import ExitCode

SAVE_AND_STOP = signal.SIGUSR2  # to gpuherd's worker: finish the step, save a checkpoint, exit 143
STOP_REQUESTS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
QUIT = signal.SIGQUIT  # Ctrl-\: a teardown without a save, as under torchrun (policy.py)


def stop_exit_code(signum: int) -> int:
    """What a run the supervisor was asked to stop exits with: 128+N for SIGTERM, SIGHUP and
    SIGQUIT, as a shell says; 143 for SIGUSR1/2, stop requests like SIGTERM (138 would read as
    a crash)."""
    return 128 + signum if signum in (signal.SIGTERM, signal.SIGHUP, QUIT) else int(ExitCode.SIGTERM)


@dataclass(frozen=True)
class StopRules:
    grace: float  # teardown: SIGTERM -> SIGKILL; Ctrl-C: the time to reach a save
    stop_timeout: float  # a graceful stop, saves included, never takes longer
    save_signal: int | None = SAVE_AND_STOP  # None: a --script, which gets SIGTERM instead
    teardown_signal: int = contract.TEARDOWN_SIGNAL  # "exit now" (a --script: SIGTERM)
    stacks_signal: int = contract.STACKS_SIGNAL  # "dump your stacks" (a --script: SIGUSR1)

    @classmethod
    def for_script(cls, grace: float, stop_timeout: float) -> StopRules:
        """A user's script is signalled as torchrun signals it."""
        return cls(grace, stop_timeout, save_signal=None, teardown_signal=signal.SIGTERM, stacks_signal=signal.SIGUSR1)


def within_kill_wait(stop_timeout: float, kill_wait: float) -> float:
    """The stop timeout under SLURM: over before SLURM's KillWait (SIGTERM -> SIGKILL of the
    whole job) is, with time left to kill what did not stop and write the summary."""
    margin = max(2.0, 0.1 * kill_wait)
    return min(stop_timeout, max(1.0, kill_wait - margin))


@dataclass(frozen=True)
class GracefulStop:
    """One graceful stop in progress: when it began, its hard limit, and what became of
    the final save. Immutable: each change is a new record (the policy's state holds it)."""

    started: float
    limit: float  # started + the stop timeout
    unfinished: tuple[str, ...] = ()  # "CPU0 (rank 0) was killed while saving ..."
    extended: bool = False  # the grace period was extended for a save or a step (said once)

    def next_deadline(self, now: float, grace: float, busy: bool, last_save_end: float | None) -> float | None:
        """Where the grace period ends now that it is over once: later while a worker is busy
        (saving, or still in the step it stops after: a fresh grace period from now) or just
        saved (a grace period after its save), never past the limit; None: kill now."""
        if now >= self.limit:
            return None
        if busy:
            deadline = now + grace
        elif last_save_end is not None and last_save_end >= self.started and last_save_end + grace > now:
            deadline = last_save_end + grace
        else:
            return None
        return min(self.limit, deadline)

    def killed(self, who: str, saving: bool, on_its_way_out: bool, saves_always: bool) -> GracefulStop:
        """`who` is SIGKILLed at the end of the stop: does that cut its final save?"""
        if saving:
            return replace(self, unfinished=(*self.unfinished, f"{who} was killed while saving it"))
        if saves_always and not on_its_way_out:
            return replace(self, unfinished=(*self.unfinished, f"{who} was killed before saving it"))
        return self

    def ended(self, who: str, code: int, how: str) -> GracefulStop:
        """`who` exited on its own during the stop: a failure (a save that hit a full disk)
        leaves its checkpoint unwritten."""
        if code not in (0, int(ExitCode.SIGINT), int(ExitCode.SIGTERM)):
            return replace(self, unfinished=(*self.unfinished, f"{who} {how} while stopping"))
        return self

    def outcome(self, saved: bool) -> str | None:
        """For the summary: "not saved" (some worker did not finish its save), "saved", or
        None when no worker reported a save (nothing to say)."""
        if self.unfinished:
            return "not saved"
        return "saved" if saved else None
