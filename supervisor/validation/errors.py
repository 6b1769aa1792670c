"""The one error of a launch's checks: a usage error (exit 2), one line."""

from __future__ import annotations

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode


class LaunchError(GpuherdError):
    """Something the run would trip over later (a bad path, too many workers): said now,
    before anything is written or spawned."""

    exit_code = ExitCode.USAGE
