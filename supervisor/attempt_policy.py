"""The attempt loop's policy: what follows an attempt, as a pure function of what it reported.

`next_attempt(state, event, rules) -> (state, decision)`, in the style of the supervision
policy (processes/policy.py): the state is one immutable record (`State`: the attempt under
way, the devices it runs on, the quick failures in a row, the restarts used, the live
recoveries, the GPUs left out); an event says what happened (`AttemptEnded`, the dataset
check's answer `DatasetChecked`, a stop signal between attempts `Interrupted`); a decision
says what to do (`CheckDataset`, `Restart`, `Stop`). No process, file or clock here: job.py
runs the attempts, checks the cache, pauses and writes the records, and
tests/supervisor/test_attempt_policy.py drives every branch with synthetic events in
milliseconds. The flow (docs/design/restarts.md):

    AttemptEnded --success--> Stop(None)
    AttemptEnded --a node asks to join (elastic)--> Restart (at once, not counted) | Stop (a stop signal)
    AttemptEnded --failure, the built-in trainer--> CheckDataset --DatasetChecked--> Restart | Stop
    AttemptEnded --failure, a --script--> Restart | Stop
        (Restart: after the backoff, from the newest checkpoint this run saved, without the
        suspect GPUs under --exclude-suspect-gpus; Stop: why not, in words)
    Interrupted (a stop signal in the pause, or between attempts) --> Stop(its cause)

`--max-restarts` counts restarts and live recoveries alike (`State.used`): the budget the next
attempt's live recovery gets is what is left (`State.live_budget`). A restart's rules (which
failure is worth one, the backoff) are restarts.py's `plan_restart`; the exclusion's,
`exclude_suspects`. Whether node 0 asks SLURM to requeue a preempted job at the end is
`requeue_wanted`.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace

from gpuherd.exit_codes import ExitCode
from supervisor.gpus import DevicePlan
from supervisor.processes import stop_exit_code
from supervisor.restarts import Exclusion, RestartPlan, exclude_suspects, plan_restart
from supervisor.summary import RootCause, SuspectDevice

# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Rules:
    """Fixed for the run (the config's `system` keys)."""

    max_restarts: int
    train: bool  # the built-in trainer: its dataset cache is checked again before a restart
    restart_on_nan: bool = False
    base_backoff: float = 0.2
    exclude_suspect_gpus: bool = False
    multi_node: bool = False


@dataclass(frozen=True)
class AttemptEnded:
    """An attempt is over, every process of it gone."""

    cause: RootCause | None  # None: it succeeded
    ran_s: float
    stop_signal: str | None = None  # the supervisor was asked to stop during it (SIGTERM, ...)
    progressed: bool = False  # it completed a training step
    recovered: int = 0  # live recoveries it completed (each one of --max-restarts)
    suspects: tuple[SuspectDevice, ...] = ()  # devices its ranks blamed for transient faults
    newest: str | None = None  # the newest complete checkpoint this run saved, still as saved
    saw: str | None = None  # a --script: what gpuherd saw of its saves, in words (it writes none for a script)


@dataclass(frozen=True)
class DatasetChecked:
    """`CheckDataset`'s answer: the cache was reused, rebuilt, or could not be rebuilt."""

    failure: str | None = None  # why it cannot be rebuilt
    rebuilt: bool = False


@dataclass(frozen=True)
class Interrupted:
    """A stop signal between attempts."""

    signum: int
    in_pause: bool = True  # during the pause before the next attempt (else: in the instant around it)


Event = AttemptEnded | DatasetChecked | Interrupted


# ---------------------------------------------------------------------------- decisions


@dataclass(frozen=True)
class CheckDataset:
    """Check the dataset cache (rebuild it if it went missing or was damaged) and answer
    with `DatasetChecked`: the restart depends on it."""


@dataclass(frozen=True)
class Restart:
    """Run attempt `attempt` after `delay` seconds."""

    attempt: int
    delay: float
    resume: str | None  # the checkpoint handed to the workers (None: as the first attempt started)
    plan: DevicePlan  # its devices
    after: RootCause  # what ended the attempt before
    membership: bool = False  # an elastic job's membership change: not one of --max-restarts
    exclude_gpus: tuple[int, ...] = ()  # suspect GPUs left out from this attempt on
    said: tuple[str, ...] = ()  # warnings to log first (the exclusion's)
    message: str = ""  # the one warning line that announces the restart


@dataclass(frozen=True)
class Stop:
    """The run ends with `cause` (None: success)."""

    cause: RootCause | None
    not_restarted: str | None = None  # why the last attempt was not restarted (said only where restarts were on)


Decision = CheckDataset | Restart | Stop


# ---------------------------------------------------------------------------- state


@dataclass(frozen=True)
class Waiting:
    """A failed attempt whose restart waits for the dataset check."""

    ended: AttemptEnded
    plan: RestartPlan


@dataclass(frozen=True)
class State:
    plan: DevicePlan  # the devices of the attempt under way
    attempt: int = 0  # the attempt under way
    streak: int = 0  # quick failures in a row: each doubles the pause
    restarts_used: int = 0  # failures restarted; a membership change is not one
    recovered: int = 0  # live recoveries completed, every attempt's
    excluded: tuple[int, ...] = ()  # every GPU left out so far, in the order they were
    cpu_told: bool = False  # the exclusion said it has nothing to exclude on CPU workers
    waiting: Waiting | None = None

    @property
    def used(self) -> int:
        """Of --max-restarts: restarts and live recoveries alike."""
        return self.restarts_used + self.recovered

    def live_budget(self, rules: Rules) -> int:
        """The live recoveries the attempt under way may still do."""
        return rules.max_restarts - self.used


Result = tuple[State, Decision]


def next_attempt(state: State, event: Event, rules: Rules) -> Result:
    return _HANDLERS[type(event)](state, event, rules)


# ---------------------------------------------------------------------------- handlers


def _ended(s: State, e: AttemptEnded, r: Rules) -> Result:
    s = replace(s, recovered=s.recovered + e.recovered)
    if e.cause is None:
        return s, Stop(None)
    plan = plan_restart(e.cause, stop_signal=e.stop_signal, attempt=s.used, max_restarts=r.max_restarts,
                        train=r.train, restart_on_nan=r.restart_on_nan, base_backoff=r.base_backoff,
                        streak=s.streak, ran_s=e.ran_s, progressed=e.progressed)
    s = replace(s, waiting=Waiting(e, plan))
    if plan.check_dataset:  # never for a membership change: nobody's failure
        return s, CheckDataset()
    return _restart(s, r, plan.why_not)


def _dataset_checked(s: State, e: DatasetChecked, r: Rules) -> Result:
    if e.failure is not None:
        return _restart(s, r, f"the dataset cache cannot be rebuilt: {e.failure}")
    return _restart(s, r, None if e.rebuilt else s.waiting.plan.why_not)  # a dataset error: restart once rebuilt


def _interrupted(s: State, e: Interrupted, r: Rules) -> Result:
    when = f"during the pause before attempt {s.attempt}" if e.in_pause else "between attempts"
    return replace(s, waiting=None), Stop(stop_cause(e.signum, when))


_HANDLERS = {AttemptEnded: _ended, DatasetChecked: _dataset_checked, Interrupted: _interrupted}


# ---------------------------------------------------------------------------- steps


def _restart(s: State, r: Rules, why_not: str | None) -> Result:
    """Restart unless `why_not`; a counted restart leaves the suspect GPUs out first."""
    if why_not:
        return _stop(s, r, why_not)
    ended, plan = s.waiting.ended, s.waiting.plan
    membership, number = not plan.counted, s.attempt + 1
    exclusion = Exclusion(s.plan, cpu_told=s.cpu_told) if membership else exclude_suspects(
        s.plan, ended.cause, ended.suspects, number, enabled=r.exclude_suspect_gpus, multi_node=r.multi_node,
        cpu_told=s.cpu_told)
    s = replace(s, cpu_told=exclusion.cpu_told)
    if exclusion.refused:
        return _stop(s, r, exclusion.refused)
    used = s.used
    s = replace(s, attempt=number, waiting=None, plan=exclusion.plan, excluded=s.excluded + exclusion.gpus,
                streak=s.streak if membership else plan.streak,  # a membership change is no failure in a row
                restarts_used=s.restarts_used + (0 if membership else 1))
    message = (f"attempt {number - 1} " + ("ended" if membership else "failed") + f" ({ended.cause.message}); "
               + ("restarting" if membership else f"restart {used + 1} of {r.max_restarts}")
               + f" in {plan.delay:g} s, "
               + _resumes(ended))
    return s, Restart(number, plan.delay, ended.newest, s.plan, ended.cause, membership=membership,
                      exclude_gpus=exclusion.gpus, said=exclusion.said, message=message)


def _resumes(ended: AttemptEnded) -> str:
    """What the next attempt starts from, as far as gpuherd knows it."""
    if ended.newest:
        return f"resuming from {ended.newest}"
    if ended.saw is not None:  # a script resumes from what it saved, if it does: its code decides
        return f"the script starts again with the same command; {ended.saw}"
    return "starting as the first attempt did (no checkpoint written yet)"


def _stop(s: State, r: Rules, why_not: str) -> Result:
    return replace(s, waiting=None), Stop(s.waiting.ended.cause, why_not if r.max_restarts else None)


# ---------------------------------------------------------------------------- causes and the end


def stop_cause(signum: int, when: str) -> RootCause:
    """The run stopped by a signal to the supervisor outside an attempt's supervision."""
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return RootCause("interrupted", ExitCode.SIGINT, f"interrupted by Ctrl-C (SIGINT) {when}", signal=name)
    return RootCause("terminated", stop_exit_code(signum), f"the supervisor received {name} {when}", signal=name)


def requeue_wanted(cause: RootCause | None, *, node_rank: int, slurm_job_id: str | None) -> bool:
    """Node 0 of a SLURM job that ended by preemption asks SLURM to requeue it (slurm_env's
    `requeue_after_preemption` then reads whether the job and its partition allow it)."""
    return node_rank == 0 and bool(slurm_job_id) and cause is not None and cause.preempted
