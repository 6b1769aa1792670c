"""What wakes the supervision loop (supervision.py) out of its epoll wait: a non-blocking pipe
that the signal handlers (through signal.set_wakeup_fd) and other threads write a byte to.

A handled signal is also noted in `signals`, in order, for the loop to act on; a signal that
was ignored when gpuherd started stays ignored for the whole run (signal_rules.py).
"""

from __future__ import annotations

import os
import signal

from supervisor.processes.signal_rules import inherited_ignored


class WakeUps:
    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        for fd in (self.read_fd, self._write_fd):
            os.set_blocking(fd, False)
        self.signals: list[int] = []  # handled signals not acted on yet, oldest first
        self._old_handlers: dict[int, object] = {}
        self._old_wakeup = -1

    def install(self, handled: tuple[int, ...]) -> None:
        """Before the first spawn: a SIGCHLD or Ctrl-C from then on is never missed."""
        def on_signal(signum: int, _frame: object) -> None:
            self.signals.append(signum)

        for sig in handled:
            if sig not in inherited_ignored():  # ignored when gpuherd started: ignored for the whole run
                self._old_handlers[sig] = signal.signal(sig, on_signal)
        self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)

    def restore(self) -> None:
        """The handlers before `install` back, and the pipe closed."""
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        os.close(self.read_fd)
        os.close(self._write_fd)

    def wake(self) -> None:
        """Thread-safe: the loop wakes up now."""
        try:
            os.write(self._write_fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake already

    def drain(self) -> None:
        """Every byte written so far read (the loop is awake: they have done their job)."""
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass
