"""worker/spare_fork.py: when a spare source refuses to fork (the rest, with real processes:
tests/supervisor/test_spare_source.py)."""

from __future__ import annotations

import json
import os
import socket
import threading

import psutil

from worker import spare_fork


def _ask(sock: socket.socket) -> list[int]:
    """A fork request with four fresh pipe ends; the ends kept here, to be closed."""
    pipes = [os.pipe() for _ in range(4)]
    socket.send_fds(sock, [b"fork"], [r for r, _ in pipes])
    return [fd for pair in pipes for fd in pair]


def test_a_source_running_a_python_thread_answers_with_an_error_and_forks_nothing():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    release = threading.Event()
    busy = threading.Thread(target=release.wait, daemon=True)
    busy.start()
    fds = _ask(ours)
    try:
        before = {p.pid for p in psutil.Process().children()}
        assert spare_fork._answer(theirs) == "served"
        answer = json.loads(ours.recv(4096))
        assert "pid" not in answer and "Python threads: no fork" in answer["error"]
        assert {p.pid for p in psutil.Process().children()} <= before  # nothing forked
    finally:
        release.set()
        busy.join()
        for fd in fds:
            os.close(fd)
        ours.close()
        theirs.close()


def test_the_supervisor_closing_its_end_stops_the_serving():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ours.close()
    try:
        assert spare_fork._answer(theirs) == "closed"
    finally:
        theirs.close()


def test_a_loaded_cuda_driver_is_seen_in_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not spare_fork.cuda_driver_loaded(str(maps))
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n")
    assert spare_fork.cuda_driver_loaded(str(maps))
    assert not spare_fork.cuda_driver_loaded(str(tmp_path / "none"))
