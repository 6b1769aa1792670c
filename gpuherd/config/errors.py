"""`ConfigError`, and the "did you mean" hint every config message may end with."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode


class ConfigError(GpuherdError, ValueError):
    """A config problem, phrased as one line for the user; nothing was started or written."""

    exit_code = ExitCode.USAGE


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest choice, or "" when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
