"""One rule per signal for the whole run, preparation included.

A stop signal the supervisor inherited as ignored (`nohup` ignores SIGHUP; a shell's
background job and some CI runners ignore SIGINT) stays ignored from start to end: the
dataset build, every attempt and the pauses between them, so a signal never means
"nothing" in one phase and "stop" in the next. Every other stop signal stops the run in
every phase: during the dataset build it raises `StopSignal` in the main thread, the
build cleans up (its tokenizer processes included) and the run ends with that
signal's cause and a summary.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


@cache
def inherited_ignored() -> frozenset[int]:
    """The stop signals ignored when the supervisor started (called first before any handler
    of ours is installed: main.py does, so the answer is the inherited one)."""
    return frozenset(sig for sig in STOP_SIGNALS if signal.getsignal(sig) == signal.SIG_IGN)


def honoured(signals: tuple[int, ...]) -> tuple[int, ...]:
    """`signals` without those inherited as ignored."""
    ignored = inherited_ignored()
    return tuple(sig for sig in signals if sig not in ignored)


def ignored_notice() -> str | None:
    ignored = sorted(inherited_ignored())
    if not ignored:
        return None
    names = ", ".join(signal.Signals(sig).name for sig in ignored)
    stop = "SIGTERM" if signal.SIGTERM not in ignored else "SIGKILL"
    return (f"{names} {'was' if len(ignored) == 1 else 'were'} ignored when gpuherd started (nohup, a background "
            f"job, a CI runner): {'it stays' if len(ignored) == 1 else 'they stay'} ignored for the whole run; "
            f"stop it with {stop}")


class StopSignal(BaseException):
    """A stop signal arrived while the run was not yet supervising workers. A BaseException,
    as KeyboardInterrupt: no `except Exception` in a library swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stops_raise() -> Iterator[None]:
    """Within the block, each honoured stop signal raises StopSignal (main thread only)."""
    def on_signal(signum: int, _frame: object) -> None:
        raise StopSignal(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in honoured(STOP_SIGNALS)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def stops_recorded() -> Iterator[list[int]]:
    """Within the block, each honoured stop signal is appended to the list yielded, nothing
    raised (main thread only). A handler, not a blocked mask: a signal the main thread blocks
    goes to another thread of ours and its Python handler would still run here."""
    seen: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        seen.append(signum)

    old = {sig: signal.signal(sig, on_signal) for sig in honoured(STOP_SIGNALS)}
    try:
        yield seen
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
