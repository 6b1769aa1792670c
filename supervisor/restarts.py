"""Automatic restarts (`--max-restarts N`): which failures are worth another attempt,
where the next attempt resumes, and the pause between attempts.

torchrun restarts the worker group but leaves resuming to the script. Here the
supervisor also picks the checkpoint: the newest one *this run's* workers reported
saving (their `checkpoint` status records), still as it was when they reported it,
handed to the workers as `GPUHERD_RESUME`. A checkpoint another run wrote into a
shared directory — before this run, or while it ran, even under the same name — is
never picked up. With none written yet, the next attempt starts as the first one did.

The pause is short (`system.restart_backoff`, 0.2 s by default: a restart is cheap, the
store helper stays warm) and doubles for each further failure in a row, up to
`MAX_BACKOFF_S`, so a job that fails at once every time does not spin; an attempt
that completed a training step (`Progress`), or ran for `STREAK_RESET_S`, before failing
was not failing quickly: it starts the doubling over.

After an exit 8 (a device kept producing transient faults), `--exclude-suspect-gpus`
runs the next attempt without the GPUs that went over the limit: one worker fewer
each, never a stand-in GPU, so the job's shape changes only by what was left out. A GPU
struck out by silent data corruption (its replica disagreed twice) is left out whatever
the flag says: it computed wrong numbers without a sign, twice.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from gpuherd.checkpoint_layout import fingerprint
from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Checkpoint, Record, Step
from supervisor.gpus import DeviceError, DevicePlan, exclude_gpus
from supervisor.processes import stops_recorded
from supervisor.summary import SDC_CAUSE, CauseKind, RootCause, SuspectDevice

# SIGUSR1/2 too: SLURM's warning before the time limit may come between two attempts
MAX_BACKOFF_S = 60.0
STREAK_RESET_S = 600.0
PAUSE_SLICE_S = 0.1  # how late a stop signal another thread took may end the pause


def backoff(base: float, streak: int) -> float:
    """The pause before a restart after `streak` earlier quick failures in a row (0 for the first)."""
    return min(base * 2 ** streak, max(base, MAX_BACKOFF_S))


def refusal(cause: RootCause, restart_on_nan: bool) -> str | None:
    """Why this failure is not restarted (None: restart it). A failure that would only
    repeat (config, dataset) or that someone asked for (Ctrl-C, SIGTERM) ends the run.
    A user script's own exit code means what the script means by it: restarted like any crash."""
    if cause.kind in (CauseKind.INTERRUPTED, CauseKind.TERMINATED):
        return "the run was asked to stop"
    if cause.kind == "supervisor":
        return "the supervisor itself failed"
    if cause.script_code:
        return None
    if cause.exit_code == ExitCode.USAGE:
        return "a usage or config error fails every attempt the same way"
    if cause.exit_code == ExitCode.DATA:
        return "a dataset error fails every attempt the same way"
    if cause.exit_code == ExitCode.STORAGE:
        return "a full, over-quota or read-only disk fails every attempt the same way"
    if cause.exit_code == ExitCode.NAN and not restart_on_nan:
        return "a NaN stop is not restarted unless --restart-on-nan is given"
    if cause.exit_code == ExitCode.DATA_MODEL:
        return "the suspicious step reproduced on replay: the batch or the model fails every attempt the same way"
    return None


@dataclass(frozen=True)
class RestartPlan:
    """What follows a failed attempt (`plan_restart`)."""

    why_not: str | None  # None: restart; else why the run ends here
    check_dataset: bool = False  # first rebuild a missing or damaged cache; restart only if that worked,
    # or, where `why_not` is set (a dataset error), only if the cache was rebuilt
    delay: float = 0.0  # the pause before the next attempt
    streak: int = 0  # quick failures in a row, this one included
    counted: bool = True  # one of --max-restarts (a membership restart is not, as under torchrun)


class Progress:
    """Did an attempt complete a training step (a `step` status record) before it failed?"""

    def __init__(self) -> None:
        self.made = False

    def observe(self, record: Record) -> None:
        if isinstance(record, Step):
            self.made = True


def plan_restart(cause: RootCause, *, stop_signal: str | None, attempt: int, max_restarts: int, train: bool,
                 restart_on_nan: bool, base_backoff: float, streak: int, ran_s: float,
                 progressed: bool = False) -> RestartPlan:
    """The restart policy, pure: a failed attempt (`cause`, after `ran_s` seconds, `streak`
    quick failures before it; `progressed`: it completed a step) -> restart or not, why, and after
    how long. `stop_signal`: the
    supervisor was asked to stop during the attempt (a scancel's SIGTERM may reach a worker
    first: its code alone would look like a crash). The built-in trainer's cache is checked
    again before a restart (`check_dataset`), so an exit 3 gets another attempt once repaired.
    An elastic job's membership change (a node asks to join) is nobody's failure: restarted at
    once, whatever restarts are left, and not counted, unless the supervisor was asked to stop."""
    streak = 0 if ran_s >= STREAK_RESET_S or progressed else streak
    if cause.kind == CauseKind.MEMBERSHIP:
        return RestartPlan(f"the supervisor received {stop_signal}" if stop_signal else None, streak=streak,
                           counted=False)
    why_not = refusal(cause, restart_on_nan)
    if stop_signal:
        why_not = f"the supervisor received {stop_signal}"
    if attempt >= max_restarts:
        return RestartPlan(why_not or f"all {max_restarts} restart(s) used", streak=streak)
    if not train or (why_not and cause.exit_code != ExitCode.DATA) or stop_signal:
        if why_not:
            return RestartPlan(why_not, streak=streak)
        return RestartPlan(None, delay=backoff(base_backoff, streak), streak=streak + 1)
    return RestartPlan(why_not, check_dataset=True, delay=backoff(base_backoff, streak), streak=streak + 1)


class RunCheckpoints:
    """The checkpoints this run's workers reported saving, each with the stamp it had when
    the report came: a file since replaced (another run saving the same step into a
    shared directory) or pruned no longer counts."""

    def __init__(self) -> None:
        self._saved: dict[Path, tuple[int, tuple[int, int, int]]] = {}  # path -> (step, stamp)
        self._reporters: dict[Path, set[int]] = {}  # ranks that reported the latest save of a path

    def observe(self, record: Record) -> None:
        """A status record; `checkpoint` ones (step, path) are this run's saves. Every rank
        reports a save that rank 0 wrote: the stamp is taken at the first report, so one
        that comes late cannot adopt a file another run put there meanwhile."""
        if not isinstance(record, Checkpoint) or record.path is None:
            return
        path, rank = Path(record.path).absolute(), record.rank
        reporters = self._reporters.setdefault(path, set())
        if path in self._saved and rank not in reporters:
            reporters.add(rank)  # another rank reporting the same save
            return
        try:
            step, stamp = record.step or 0, fingerprint(path)
        except (OSError, ValueError, TypeError):  # not there (a rank reporting a save it did not write)
            return
        self._saved[path] = (step, stamp)
        self._reporters[path] = {rank}

    def step_of(self, path: Path) -> int | None:
        """The step a reported checkpoint holds."""
        saved = self._saved.get(path)
        return saved[0] if saved is not None else None

    def newest_of_this_run(self) -> Path | None:
        for path, (_, stamp) in sorted(self._saved.items(), key=lambda item: item[1][0], reverse=True):
            try:
                if fingerprint(path) == stamp:
                    return path
            except OSError:  # pruned (training.keep_last) or removed
                continue
        return None


@dataclass(frozen=True)
class Exclusion:
    """`--exclude-suspect-gpus` (`system.exclude_suspect_gpus`) after a failed attempt: the
    devices of the next one (`exclude_suspects`)."""

    plan: DevicePlan  # the next attempt's (the same plan when nothing is left out)
    gpus: tuple[int, ...] = ()  # the GPUs left out from the next attempt on
    said: tuple[str, ...] = ()  # warnings for the log
    refused: str | None = None  # no GPU would be left: why the run ends (exit 8)
    cpu_told: bool = False  # "CPU workers, nothing to exclude" was said (once a run)


def exclude_suspects(plan: DevicePlan, cause: RootCause, suspects: tuple[SuspectDevice, ...] | list[SuspectDevice],
                     next_attempt: int, *, enabled: bool, multi_node: bool = False,
                     cpu_told: bool = False) -> Exclusion:
    """After an exit 8: `plan` without the suspect GPUs over the limit, pure. `multi_node`:
    this node's workers shrink; the job's world size is agreed at the join."""
    struck_out = [d for d in suspects if d.cause == SDC_CAUSE and d.over_limit]  # left out whatever the flag says
    if not (enabled or struck_out) or cause.exit_code != ExitCode.DEVICE_SUSPECT:
        return Exclusion(plan, cpu_told=cpu_told)
    who = "--exclude-suspect-gpus" if enabled else "a second silent data corruption"
    if plan.kind != "cuda":
        said = () if cpu_told else (f"{who}: CPU workers, nothing to exclude",)
        return Exclusion(plan, said=said, cpu_told=True)
    if cause.script_code and not suspects:  # a script's own exit 8, not a suspect device
        return Exclusion(plan, cpu_told=cpu_told)
    blamed = [d for d in suspects if d.gpu is not None and d.over_limit and (enabled or d.cause == SDC_CAUSE)]
    if not blamed:  # no rank could be blamed, or (multi-node) the faults were on another node
        return Exclusion(plan, said=(f"{who}: no GPU of this node went over the limit of transient "
                                     "faults: restarting on the same GPUs",), cpu_told=cpu_told)
    try:
        shrunk = exclude_gpus(plan, {d.gpu for d in blamed})
    except DeviceError as exc:
        return Exclusion(plan, refused=str(exc), cpu_told=cpu_told)
    left_out = ", ".join(f"GPU {d.gpu} ({d.transient_faults} {d.cause}s, limit {d.limit})" for d in blamed)
    size = "this node's workers" if multi_node else "world size"
    kept = ", ".join(f"GPU {s.device_id}" for s in shrunk.slots)
    return Exclusion(shrunk, gpus=tuple(sorted({d.gpu for d in blamed if d.gpu is not None})), cpu_told=cpu_told,
                     said=(f"{who}: attempt {next_attempt} runs without {left_out}: "
                           f"{size} {plan.world_size} -> {shrunk.world_size} ({kept})",))


def mark_excluded(suspects: list[SuspectDevice], gpus: tuple[int, ...], next_attempt: int) -> None:
    """What came of each suspect device left out, for the summary and the report."""
    for d in suspects:
        if d.gpu in gpus and d.over_limit:
            d.then = f"excluded from attempt {next_attempt} on"


def held_stop_signals() -> AbstractContextManager[list[int]]:
    """Stop signals from here to the pause are kept for it: once the restart "in N s" is said,
    a Ctrl-C is one during that pause, not an exception somewhere in the bookkeeping before it."""
    return stops_recorded()


def pause(seconds: float, since: float | None = None, held: list[int] | None = None) -> int | None:
    """Sleep between attempts; a Ctrl-C / SIGTERM / SIGHUP / SIGQUIT / SIGUSR1 / SIGUSR2 meanwhile, or
    one `held` since `held_stop_signals`, ends the wait and is returned (the run then stops with
    that signal's cause). `since`: when the failed attempt ended (time.monotonic()): the backoff
    is a gap between attempts, not a wait after the work between them (the dataset cache's
    check, the bookkeeping), which counts in it."""
    if since is not None:
        seconds -= time.monotonic() - since
    with nullcontext(held) if held is not None else stops_recorded() as seen:
        deadline = time.monotonic() + max(0.0, seconds)
        # short sleeps: a signal another thread took runs its handler here only between them
        while not seen and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, PAUSE_SLICE_S))
        return seen[0] if seen else None
