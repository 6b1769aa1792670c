"""worker/spare_fork.py: when a spare source refuses to fork (the rest, with real processes:
tests/supervisor/test_spare_source.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from worker import spare_fork

ROOT = Path(__file__).resolve().parents[2]


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


# A source whose warm-up thread outlives its join by LINGER_S: a pthread key whose destructor is
# usleep(its value) runs at the thread's C-level exit, after Thread.join has returned, as the
# thread-local destructors of torch and MKL run after the warm-up's Python part.
LINGER_S = 1.0
LINGERING_SOURCE = f"""
import ctypes, json, os, sys, threading
from worker.spare_fork import serve

libc = ctypes.CDLL(None, use_errno=True)
key = ctypes.c_uint()
assert libc.pthread_key_create(ctypes.byref(key), ctypes.cast(libc.usleep, ctypes.c_void_p)) == 0
wake_r, wake_w = os.pipe()

def warm_up():
    libc.pthread_setspecific(key, ctypes.c_void_p({int(LINGER_S * 1e6)}))
    os.write(wake_w, b"w")

loader = threading.Thread(target=warm_up)
loader.start()
print(json.dumps({{"loader": loader.native_id}}), flush=True)
if not serve(int(sys.argv[1]), wake_r, loader):
    os._exit(0)  # the forked spare
"""


def test_a_source_forks_only_once_its_warm_up_thread_has_left_the_process(tmp_path):
    """Thread.join returns before the thread's C-level exit is over; a fork in that window copies
    whatever the exiting thread holds. The answer (the fork done) comes only once the warm-up's
    thread is gone from the source's /proc/PID/task."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = _ask(ours)  # asked before the source is warm, as the pool does
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("GPUHERD_SUPERVISOR_PID", None)
    source = subprocess.Popen([sys.executable, "-c", LINGERING_SOURCE, str(theirs.fileno())], env=env,
                              pass_fds=(theirs.fileno(),), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    theirs.close()
    try:
        loader = json.loads(source.stdout.readline())["loader"]
        ours.settimeout(60)
        answer = json.loads(ours.recv(4096))
        still_there = os.path.exists(f"/proc/{source.pid}/task/{loader}")
        assert "pid" in answer, answer
        assert not still_there, "forked while the warm-up's thread was still running its exit"
    finally:
        source.stdin.close()  # end of input: the source leaves
        source.wait(timeout=30)
        for fd in fds:
            os.close(fd)
        ours.close()


def test_a_thread_still_there_after_the_wait_is_said_not_gone():
    release = threading.Event()
    busy = threading.Thread(target=release.wait, daemon=True)
    busy.start()
    try:
        assert not spare_fork.thread_gone(busy.native_id, wait_s=0.05)
    finally:
        release.set()
        busy.join()
    assert spare_fork.thread_gone(busy.native_id, wait_s=5)
