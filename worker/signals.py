"""Signal behaviour of a worker (docs/architecture.md, "Signals").

- SIGTERM: the supervisor is tearing the run down; exit 143 now, no collectives (a
  checkpoint being written in the background is waited for first).
- SIGINT: graceful stop; the loop stops at the next step boundary (all ranks
  agree through a vote), saves a checkpoint and exits 130. A second SIGINT exits 130 at once.
- SIGUSR2: save and stop (the supervisor got SIGTERM: a preemption, scancel, a time
  limit); the same graceful stop, exit 143.
- SIGUSR1: faulthandler dumps every thread's stack to stderr; training goes on.

Python runs signal handlers only between bytecodes of the main thread, which
may sit inside a collective for minutes when a peer died. So the C-level
handler's wakeup fd is read by a watcher thread that acts even then.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from loguru import logger

from gpuherd.exit_codes import ExitCode

SAVE_AND_STOP = signal.SIGUSR2  # the supervisor's name for it: supervisor/processes/stopping.py


@dataclass
class SignalState:
    stop_requested: bool = False
    stop_code: int = ExitCode.SIGINT  # what a graceful stop exits with: 130 (Ctrl-C) or 143 (save and stop)
    _read_fd: int = -1
    _thread: threading.Thread | None = field(default=None, repr=False)


# Run before a SIGTERM exits the process: a checkpoint being written in the background
# gets to finish (worker/saver.py). Not after a second SIGINT: that one means "now".
_before_exit: list[Callable[[], None]] = []


def before_exit_now(hook: Callable[[], None]) -> None:
    _before_exit.append(hook)


def forget_before_exit(hook: Callable[[], None]) -> None:
    if hook in _before_exit:
        _before_exit.remove(hook)


def _exit_now(code: int, message: str, hooks: bool = False) -> None:
    try:
        logger.warning(message)
        for hook in list(_before_exit) if hooks else []:
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - exiting anyway; say why the hook could not finish
                logger.error(f"before exiting: {type(exc).__name__}: {exc}")
        sys.stderr.flush()
    finally:
        os._exit(code)


def _watch(state: SignalState) -> None:
    while True:
        try:
            data = os.read(state._read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum == signal.SIGTERM:
                _exit_now(ExitCode.SIGTERM, "received SIGTERM: exiting now (143)", hooks=True)
            elif signum == signal.SIGINT:
                if state.stop_requested:
                    _exit_now(ExitCode.SIGINT, "second SIGINT: exiting now without a checkpoint (130)")
                state.stop_requested = True
                logger.warning("received SIGINT: stopping at the next step boundary "
                               "(checkpoint, then exit 130); press Ctrl-C again to exit at once")
            elif signum == SAVE_AND_STOP:
                _save_and_stop(state)


def _save_and_stop(state: SignalState) -> None:
    """The supervisor's stop request, distinct from SIGTERM's teardown: the ranks still agree
    on a last step and save it together."""
    if state.stop_requested:
        return  # already stopping (a Ctrl-C came first): that stop saves too
    state.stop_code, state.stop_requested = ExitCode.SIGTERM, True
    logger.warning("received SIGUSR2 (the supervisor was asked to stop): stopping at the next step boundary "
                   "(checkpoint, then exit 143)")


def install() -> SignalState:
    """Call once, from the main thread, before the process group forms."""
    state = SignalState()
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    state._read_fd = read_fd
    for signum in (signal.SIGTERM, signal.SIGINT, SAVE_AND_STOP):
        # A Python-level handler must exist for the wakeup fd to receive the signal;
        # the watcher thread does the work, so this one does nothing.
        signal.signal(signum, lambda *_: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    state._thread = threading.Thread(target=_watch, args=(state,), name="gpuherd-signals", daemon=True)
    state._thread.start()
    return state
