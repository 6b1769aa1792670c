"""TORCHELASTIC_ENABLE_FILE_TIMER=1: torch's file-based watchdog timers, as under torchrun.

torchrun starts a FileTimerServer on TORCHELASTIC_TIMER_FILE (a FIFO; by default a fresh
name in the temp directory) and gives every rank that path; a rank whose timer expires is
killed by the server. gpuherd runs the same server (file_timer_main.py) for each attempt,
before the workers exist (a rank's first timer would fail without the FIFO), with the FIFO
in the attempt's log directory unless TORCHELASTIC_TIMER_FILE names one. A rank the server
killed is the root cause as any killed rank is (exit 128+N); its message names the timer.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ENABLE_VAR = "TORCHELASTIC_ENABLE_FILE_TIMER"
FILE_VAR = "TORCHELASTIC_TIMER_FILE"
START_TIMEOUT_S = 120.0  # the helper imports torch: slow on a loaded machine


def file_timer_wanted(environ: Mapping[str, str]) -> bool:
    return str(environ.get(ENABLE_VAR)) == "1"  # torchrun's test, exactly


def timer_fifo(environ: Mapping[str, str], log_dir: Path) -> Path:
    """TORCHELASTIC_TIMER_FILE as the user set it, else a FIFO in the attempt's log directory."""
    return Path(environ.get(FILE_VAR) or log_dir / "file-timer.fifo")


class FileTimer:
    """One attempt's timer server process."""

    def __init__(self, fifo: Path, log_path: Path) -> None:
        self.fifo, self.log_path = fifo, log_path
        self.proc: subprocess.Popen | None = None

    def start(self, python: str, env: dict[str, str], run_id: str, preexec_fn: Callable[[], None]) -> int:
        """Start the server and wait for its FIFO; returns its pid (its own process group)."""
        if self.fifo.is_fifo():
            self.fifo.unlink()  # a stale one would look ready before the server made its own
        with open(self.log_path, "ab") as log:  # noqa: PTH123 - handed to the child as its stdout
            self.proc = subprocess.Popen(
                [python, "-m", "supervisor.torchrun.file_timer_main", str(self.fifo), run_id], env=env,
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=preexec_fn)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _is_fifo(self.fifo):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise OSError(f"the file timer server ({ENABLE_VAR}=1) did not start; see {self.log_path}")
            time.sleep(0.05)
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def expired(self, pid: int) -> str | None:
        """The scope of the timer whose expiry made the server kill `pid`, if it did."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # torch's own log lines
            if isinstance(event, dict) and event.get("event") == "kill worker process" and event.get("pid") == pid:
                return str(event.get("scope"))
        return None


def _is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False
