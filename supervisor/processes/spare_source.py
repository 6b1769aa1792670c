"""A script's spare source, from the supervisor's side: warm spares forked, not started.

The source is a script spare (the script's interpreter in gpuherd's bootstrap, importing torch)
that also holds one end of a SOCK_SEQPACKET socket pair (worker/spare_fork.py). A spare is asked
of it with the four pipe ends the spare will own (its stdin, stdout, stderr and status pipe);
the answer names the spare's pid once it is this process's child (reparented to the supervisor,
a child subreaper), and the spare is then handled as a spawned one: `Adopted` stands for the
subprocess.Popen the supervisor has of every other worker (its pid, its pipes, its exit).

Nothing here blocks: a request is sent and the answer read when it is there (`collect`), so a
source still importing torch never holds the supervisor.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
from loguru import logger

from gpuherd.parent_death import is_subreaper
from supervisor.gpus import DeviceSlot
from supervisor.processes.spawn import WorkerProcess, widen_pipe


class Adopted:
    """The part of subprocess.Popen a WorkerProcess uses, for a child the supervisor did not start
    itself (a spare forked by the source and reparented to it): its pid, its pipes, its exit."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int) -> None:
        self.pid, self.args, self.returncode = pid, [f"spare pid {pid}"], None
        self.stdin = open(stdin, "wb")  # noqa: SIM115 - held as Popen holds its pipes
        self.stdout, self.stderr = open(stdout, "rb"), open(stderr, "rb")  # noqa: SIM115

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (the end-of-attempt sweep): its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode


@dataclass
class _Asked:
    """A spare asked of the source, not answered yet: the supervisor's ends of its pipes."""

    stdin: int
    stdout: int
    stderr: int
    status: int
    log_path: Path

    def close(self) -> None:
        for fd in (self.stdin, self.stdout, self.stderr, self.status):
            with contextlib.suppress(OSError):
                os.close(fd)


class SpareSource:
    """The source process (a WorkerProcess, itself a spare) and the spares asked of it."""

    def __init__(self, process: WorkerProcess, sock: socket.socket, watch: Callable[[int], None],
                 log_dir: Path) -> None:
        """`watch(pgid)`: the orphan guard's, for each spare forked; `log_dir`: where spare N's log is."""
        self.process, self.sock, self.watch, self.log_dir = process, sock, watch, log_dir
        self.asked: list[_Asked] = []

    @staticmethod
    def possible() -> bool:
        """A forked spare reaches the supervisor only where it is a child subreaper."""
        return is_subreaper()

    def ask(self, number: int) -> bool:
        """Spare `number` asked (answered later: `collect`); False: the request could not be sent."""
        if self.sock.fileno() < 0:
            return False
        pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, status: (read, write) each
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]]
        ours = _Asked(pipes[0][1], pipes[1][0], pipes[2][0], pipes[3][0], self.log_dir / f"spare-{number}.log")
        try:
            socket.send_fds(self.sock, [b"fork"], theirs)
        except OSError as exc:
            logger.debug(f"spare source pid {self.process.pid}: no spare asked ({exc})")
            ours.close()
            return False
        finally:
            for fd in theirs:
                os.close(fd)
        self.asked.append(ours)
        return True

    def collect(self, slot: DeviceSlot) -> tuple[list[WorkerProcess], int]:
        """The spares answered since the last look, as workers of placeholder `slot`, and how many
        requests were refused or lost (the source gone, a fork that failed)."""
        spares, failed = [], 0
        while self.asked and self.sock.fileno() >= 0 and select.select([self.sock], [], [], 0)[0]:
            try:
                said = self.sock.recv(4096)
            except OSError:
                said = b""
            if not said:  # the source ended, or took a rank: what it was asked is lost
                failed += len(self.asked)
                self.close()
                break
            asked, answer = self.asked.pop(0), orjson.loads(said)
            if "pid" not in answer:
                logger.debug(f"spare source pid {self.process.pid}: {answer.get('error')}")
                asked.close()
                failed += 1
                continue
            spares.append(self._adopt(int(answer["pid"]), asked, slot))
        return spares, failed

    def _adopt(self, pid: int, asked: _Asked, slot: DeviceSlot) -> WorkerProcess:
        popen = Adopted(pid, asked.stdin, asked.stdout, asked.stderr)
        for stream in (popen.stdout, popen.stderr):
            widen_pipe(stream.fileno())
            os.set_blocking(stream.fileno(), False)
        os.set_blocking(asked.status, False)
        self.watch(pid)  # it leads its own process group
        return WorkerProcess(slot=slot, popen=popen, status_fd=asked.status, log_path=asked.log_path,
                             started=time.monotonic())

    def close(self) -> None:
        """No more spares of this source: the requests not answered are dropped (a spare forked for
        one meanwhile reads the end of its input and exits)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        for asked in self.asked:
            asked.close()
        self.asked = []
