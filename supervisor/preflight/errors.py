"""The one error of the checks before a run starts: a usage error (exit 2), one line."""

from __future__ import annotations

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode


class PreflightError(GpuherdError):
    """Something the run would trip over later (a bad path, too little room, too many
    workers): said now, before anything is written or spawned."""

    exit_code = ExitCode.USAGE
