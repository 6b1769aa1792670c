"""Signal behaviour of a worker (docs/reference/signals.md).

From its supervisor (gpuherd/contract.py):
- TEARDOWN_SIGNAL (SIGRTMIN): the run is being torn down; exit 143 now, no collectives (a
  checkpoint being written in the background is waited for first).
- STACKS_SIGNAL (SIGRTMAX): faulthandler dumps every thread's stack to stderr (a hang
  verdict); training goes on.
- SIGINT (Ctrl-C) / SIGUSR2 (save and stop): a graceful stop, below.

A stop request: SIGINT, SIGTERM, SIGHUP, SIGUSR1 or SIGUSR2, whoever sends it. SLURM
signals every process of a job step (proctrack/linuxproc and cgroup) on `scancel`, a
preemption, the time limit and its `--signal` warning, so the worker hears those itself,
next to its supervisor. Each is the same graceful stop the supervisor asks for: the loop
stops at the next step boundary (all ranks agree through a vote), saves a checkpoint and
exits 130 (SIGINT) or 143 (any other). Further stop signals change nothing: only the
supervisor decides "kill now" (SIGKILL, after a second Ctrl-C or its stop timeout). The
worker also tells its supervisor (a `stop` status record), so a signal that reached one
worker only (`kill -TERM <pid>`) still stops every rank of every node together.

A worker without a supervisor (standalone) keeps the plain meanings: SIGTERM exits 143
at once, a second SIGINT exits 130 at once.

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

from gpuherd import contract
from gpuherd.exit_codes import ExitCode

SAVE_AND_STOP = signal.SIGUSR2  # the supervisor's name for it: supervisor/processes/stopping.py
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@dataclass
class SignalState:
    stop_requested: bool = False
    stop_code: int = ExitCode.SIGINT  # what a graceful stop exits with: 130 (Ctrl-C) or 143 (save and stop)
    supervised: bool = False  # a supervisor is there to decide "kill now"
    stop_signal: str | None = None  # the first stop signal's name
    on_stop: Callable[[str], None] | None = field(default=None, repr=False)  # tells the supervisor
    _read_fd: int = -1
    _thread: threading.Thread | None = field(default=None, repr=False)


# Run before a teardown (or, standalone, a SIGTERM) exits the process: a checkpoint being
# written in the background gets to finish (worker/saver.py). Not after a second SIGINT:
# that one means "now".
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
            handle(state, signum)


def handle(state: SignalState, signum: int) -> None:
    """What one signal does (the watcher thread calls this; tests call it directly)."""
    if signum == contract.TEARDOWN_SIGNAL:
        _exit_now(ExitCode.SIGTERM, "the supervisor is tearing the run down: exiting now (143)", hooks=True)
    if signum not in STOP_SIGNALS:
        return
    name = signal.Signals(signum).name
    if not state.supervised and (signum == signal.SIGTERM or (signum == signal.SIGINT and state.stop_requested)):
        _exit_now(128 + signum, f"{'second ' if state.stop_requested else ''}{name} without a supervisor: "
                                f"exiting now ({128 + signum})", hooks=signum == signal.SIGTERM)
    if state.stop_requested:
        logger.debug(f"received {name} while already stopping: the supervisor decides whether to kill")
        return
    state.stop_code = ExitCode.SIGINT if signum == signal.SIGINT else ExitCode.SIGTERM
    state.stop_requested, state.stop_signal = True, name
    # INFO: the supervisor prints the one warning per node a planned stop deserves
    logger.info(f"received {name}: stopping at the next step boundary (checkpoint, then exit {int(state.stop_code)})")
    if state.on_stop is not None:
        state.on_stop(name)


def report_stops(state: SignalState, on_stop: Callable[[str], None]) -> None:
    """From now on the first stop request is also reported through `on_stop`; one that came
    before the reporter existed is reported now."""
    state.on_stop = on_stop
    if state.stop_requested and state.stop_signal is not None:
        on_stop(state.stop_signal)


def install(on_stop: Callable[[str], None] | None = None) -> SignalState:
    """Call once, from the main thread, before the process group forms. `on_stop(name)` is
    called (from the watcher thread) at the first stop request."""
    state = SignalState(supervised=os.environ.get(contract.SUPERVISED) == "1", on_stop=on_stop)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    state._read_fd = read_fd
    for signum in (*STOP_SIGNALS, contract.TEARDOWN_SIGNAL):
        # A Python-level handler must exist for the wakeup fd to receive the signal;
        # the watcher thread does the work, so this one does nothing.
        signal.signal(signum, lambda *_: None)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    faulthandler.register(contract.STACKS_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
    state._thread = threading.Thread(target=_watch, args=(state,), name="gpuherd-signals", daemon=True)
    state._thread.start()
    return state
