"""Run a command in a pseudo-terminal and read the screen it leaves, as a user would see it.

pyte emulates the terminal (cursor moves, redraws, colours), so a test sees the
final frame of a live view, not the raw escape codes.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import termios
import time
from dataclasses import dataclass
from pathlib import Path

import pyte


@dataclass
class Screen:
    screen: pyte.Screen
    returncode: int

    @property
    def lines(self) -> list[str]:
        return [line.rstrip() for line in self.screen.display]

    def text(self) -> str:
        return "\n".join(self.lines)

    def row_of(self, needle: str) -> int:
        for i, line in enumerate(self.lines):
            if needle in line:
                return i
        raise AssertionError(f"{needle!r} not on the screen:\n{self.text()}")

    def backgrounds(self, row: int) -> set[str]:
        """Background colours of the printed (non-blank) cells of one row."""
        line = self.screen.buffer[row]
        return {line[x].bg for x in range(self.screen.columns) if line[x].data.strip()}


def run_in_terminal(cmd: list[str], cwd: Path, env: dict[str, str], columns: int = 220, rows: int = 40,
                    timeout: float = 60.0) -> Screen:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    env = {**env, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    env.pop("LINES", None)
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    screen = pyte.Screen(columns, rows)
    stream = pyte.ByteStream(screen)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                stream.feed(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            raise AssertionError(f"{cmd} still running after {timeout} s:\n" + "\n".join(screen.display))
    finally:
        os.close(master)
    return Screen(screen, proc.wait(timeout=10))
