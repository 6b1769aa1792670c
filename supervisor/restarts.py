"""Automatic restarts (`--max-restarts N`): which failures are worth another attempt,
where the next attempt resumes, and the pause between attempts.

torchrun restarts the worker group but leaves resuming to the script. Here the
supervisor also picks the checkpoint: the newest complete one *this run* wrote
(a `step_*` left in a shared checkpoint directory by an earlier run is never
picked up by accident), handed to the workers as `GPUHERD_RESUME`. With none
written yet, the next attempt starts as the first one did.

The pause is short (`system.restart_backoff`, 0.2 s by default: a restart is cheap, the
store helper stays warm) and doubles for each further failure in a row, up to
`MAX_BACKOFF_S`, so a job that fails at once every time does not spin; an attempt
that ran for `STREAK_RESET_S` before failing starts the doubling over.
"""

from __future__ import annotations

import signal
from pathlib import Path

from gpuherd.checkpoint_layout import fingerprint, list_checkpoints
from gpuherd.exit_codes import ExitCode
from supervisor.summary import RootCause

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MAX_BACKOFF_S = 60.0
STREAK_RESET_S = 600.0


def backoff(base: float, streak: int) -> float:
    """The pause before a restart after `streak` earlier quick failures in a row (0 for the first)."""
    return min(base * 2 ** streak, max(base, MAX_BACKOFF_S))


def refusal(cause: RootCause, restart_on_nan: bool) -> str | None:
    """Why this failure is not restarted (None: restart it). A failure that would only
    repeat (config, dataset) or that someone asked for (Ctrl-C, SIGTERM) ends the run."""
    if cause.kind in ("interrupted", "terminated"):
        return "the run was asked to stop"
    if cause.exit_code == ExitCode.USAGE:
        return "a usage or config error fails every attempt the same way"
    if cause.exit_code == ExitCode.DATA:
        return "a dataset error fails every attempt the same way"
    if cause.exit_code == ExitCode.NAN and not restart_on_nan:
        return "a NaN stop is not restarted unless --restart-on-nan is given"
    if cause.kind == "supervisor":
        return "the supervisor itself failed"
    return None


class RunCheckpoints:
    """What the checkpoint directory held when the run started, to tell this run's
    checkpoints from older ones."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._before = self._fingerprints()

    def _fingerprints(self) -> dict[Path, tuple[int, int]]:
        found = {}
        for _, path in list_checkpoints(self.directory):
            try:
                found[path] = fingerprint(path)
            except OSError:  # pruned between listing and stat
                continue
        return found

    def newest_of_this_run(self) -> Path | None:
        for _, path in reversed(list_checkpoints(self.directory)):
            try:
                if self._before.get(path) != fingerprint(path):
                    return path
            except OSError:
                continue
        return None


def pause(seconds: float) -> int | None:
    """Sleep between attempts; a Ctrl-C / SIGTERM / SIGHUP meanwhile ends the wait and
    is returned (the run then stops with that signal's cause)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        info = signal.sigtimedwait(STOP_SIGNALS, max(0.0, seconds))  # consumes the signal it reports
        return None if info is None else info.si_signo
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
