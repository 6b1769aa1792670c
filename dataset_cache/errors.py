"""The two ways the dataset cache fails, each phrased as one line for the user."""

from __future__ import annotations

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode


class DatasetError(GpuherdError):
    """The cache could not be built, fetched or verified.

    The message is one line naming the culprit (a file, a package, a setting) and,
    where there is one, the fix. Entry points print it and exit with
    `ExitCode.DATA` (3), never with a traceback.
    """

    exit_code = ExitCode.DATA


class CacheCorruptError(DatasetError):
    """A published cache does not match its own metadata (truncated, flipped bytes,
    missing files). `prepare_cache` reports it and rebuilds; a worker that opens
    such a cache directly stops with exit code 3 instead of training on it."""
