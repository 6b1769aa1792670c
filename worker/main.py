"""Turning a worker's outcome into its exit code: one line for the user, never a traceback
for a failure whose cause we know (docs/reference/exit-codes.md)."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from loguru import logger

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.status_channel import StatusWriter


def exit_code_of(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for a failure."""
    if isinstance(exc, GpuherdError):  # config, dataset, worker, NaN stop: each knows its code
        return exc.exit_code, str(exc) or type(exc).__name__
    return ExitCode.FAILURE, f"{type(exc).__name__}: {exc}"


def guarded(body: Callable[[], int], status: StatusWriter) -> int:
    """Run `body`; map every failure to its exit code, report it, never re-raise."""
    try:
        return body()
    except KeyboardInterrupt:  # only before the signal handlers are installed
        return int(ExitCode.SIGINT)
    except Exception as exc:  # noqa: BLE001 - this is the one place that classifies failures
        code, message = exit_code_of(exc)
        if not isinstance(exc, GpuherdError):
            # an unclassified failure: the traceback is the diagnosis
            logger.error("worker failed:\n" + "".join(traceback.format_exception(exc)).rstrip())
        else:
            logger.error(message)
        status.send("error", message=message[:2000], exit_code=int(code))
        sys.stderr.flush()
        return int(code)
