"""The console never blocks the supervisor: a terminal that stops reading costs console
lines (counted, said later), never heartbeats or teardown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from supervisor.output.console import STDOUT, Console
from tests.supervisor import helpers as sh


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_writes_return_at_once_on_a_terminal_that_does_not_read():
    r, w = os.pipe()  # a 64 KiB pipe nobody reads: a paused pager
    console = Console(max_pending=200_000, notice_fd=w)
    line = b"x" * 99 + b"\n"
    t0 = time.monotonic()
    for _ in range(5_000):  # 500 KB: far more than the pipe and the buffer hold
        console.write(w, line)
    assert time.monotonic() - t0 < 1.0
    assert console.left_out > 0
    left_out = console.left_out

    def told(data: bytes) -> int:  # lines the notices (one per run of left-out lines) account for
        return sum(int(n) for n in re.findall(rb"fell behind: (\d+) line", data))

    got = b""
    deadline = time.monotonic() + 10
    while told(got) < left_out and time.monotonic() < deadline:  # the terminal reads again
        got += _drain(r)
        time.sleep(0.01)
    console.close()
    got += _drain(r)
    os.close(r)
    os.close(w)
    assert told(got) == left_out
    assert got.count(line) + left_out == 5_000  # every line either shown or counted


def test_close_gives_up_on_a_stuck_terminal():
    r, w = os.pipe()
    console = Console()
    console.write(w, b"y" * (1 << 20))  # more than the pipe takes
    t0 = time.monotonic()
    console.close(timeout=0.5)
    assert time.monotonic() - t0 < 2.0
    os.close(r)  # unblocks the writer thread (EPIPE): it ends quietly
    os.close(w)


def test_closed_terminal_stops_only_the_console():
    r, w = os.pipe()
    os.close(r)
    console = Console()
    console.write(w, b"line\n")
    console.close()
    assert console.closed
    console.write(STDOUT, b"ignored\n")
    os.close(w)


def test_supervisor_finishes_while_nobody_reads_its_stdout(tmp_path):
    """Before: a flooding worker filled the terminal's pipe, the supervisor blocked in
    write() and never noticed anything again."""
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--script",
                                 str(sh.SCENARIO), "flood:200000", "flood:200000"],
                                cwd=tmp_path, env=sh.env(), stdout=subprocess.PIPE, stderr=err)
        try:
            code = proc.wait(timeout=120)  # stdout is never read until the end
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()
            proc.wait()
    assert code == 0, (tmp_path / "err.txt").read_text()[-2000:]
    assert "note: the console fell behind" in (tmp_path / "err.txt").read_text()
    logs = sorted((tmp_path / "logs").glob("*/worker-rank*.log"))
    assert [len(p.read_bytes().splitlines()) for p in logs] == [200_000, 200_000]  # the files have everything
