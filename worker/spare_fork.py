"""A script's spare source: one warm interpreter that forks the script's warm spares.

A script's warm spare is its interpreter waiting in the bootstrap with torch imported
(worker/script_bootstrap.py, `stand_by`). Importing torch, torch.distributed and torch._dynamo
costs a 2-core machine 2-3 s of CPU, and a spare refilled after a recovery paid it beside the
training ranks: each process is a session of its own, so the kernel's autogroups gave it a rank's
share of the CPU whatever its nice value (the ranks slowed), and it was still importing 5 s later
when a second rank was lost (that recovery waited for the rest of its import: 1.5-3 s instead of
0.7-1.0). A fork of a process that has imported torch is as warm as it is, at once, for a few ms
of CPU.

The source is started as a spare is, with `GPUHERD_SPARE_SOURCE_FD` naming its end of a
SOCK_SEQPACKET socket pair. Once its import is over, each message `fork` on that socket, with
four fds (the new spare's stdin, stdout, stderr and status pipe ends), is answered with one
JSON line: `{"pid": N}`, a warm spare waiting on its own stdin, or `{"error": "..."}` (the
supervisor then starts a spare afresh, as without a source). The spare is forked twice (the
middle process exits at once), so it is reparented to the supervisor, a child subreaper: the
supervisor sees its exit (SIGCHLD, its status) as it sees any worker's; it is answered only
once the middle process is reaped, i.e. once the spare is the supervisor's child. The spare
leads a session of its own (its process group for the teardown, its autogroup: it trains at a
rank's share of the CPU once promoted), takes the supervisor's death as its own once it is the
supervisor's child (PR_SET_PDEATHSIG), and keeps nothing of the source's (its socket, pipes).

Forked only while the source runs no Python thread but its main one, and only once the import's
thread has left the kernel's thread list too: a fork copies no other thread, and a lock one of
them held would stay held in the child. `Thread.join` returns as soon as the thread's Python part
is over, while the thread itself still runs its C-level exit (the thread-local destructors of
torch's and MKL's per-thread state, glibc's): measured on a 2-core machine at load 20-28, the
warm-up's thread (nice 19) was still running at 40 of 63 forks, for 18-190 ms after its join, so
the source waits for it to be gone (`thread_gone`) before it serves a request.
Native threads are left to their libraries' fork handlers: torch's import leaves one, numpy's
OpenBLAS thread server (`blas_thread_server`, waiting on its condition variable), which OpenBLAS
shuts down around a fork itself, as in every process that forks DataLoader workers; torch's own
intra-op (OpenMP) pool is started only by a first operation, which a script's source never runs
(the built-in's rehearsal runs its step in the warm-up thread, whose pool ends with it). Nor is
one forked once the CUDA driver is loaded (libcuda mapped): a fork cannot use it, and a spare
touches CUDA only once its assignment names the GPU. The
source still waits on its stdin as any spare does: handed a rank (no fork of it was there yet), it
serves no more spares and becomes the rank.

Standard library only: it runs in the script's interpreter, as the bootstrap does.
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
from typing import Callable

SPARE_SOURCE_FD = "GPUHERD_SPARE_SOURCE_FD"  # gpuherd/contract.py's name
SUPERVISOR_PID = "GPUHERD_SUPERVISOR_PID"
STATUS_FD = "GPUHERD_STATUS_FD"
REPARENT_WAIT_S = 5.0  # the middle process's exit hands the spare to the supervisor: far less than this
THREAD_EXIT_WAIT_S = 10.0  # a joined thread's C-level exit: ms, a few hundred at nice 19 beside busy ranks
PR_SET_PDEATHSIG = 1


def serve(sock_fd: int, wake_fd: int, loader: threading.Thread, stdin_fd: int = 0) -> bool:
    """Serve fork requests on `sock_fd` once `loader` (the import) has ended, which it says on
    `wake_fd`, until this process's own stdin is readable. True: this is the source, and its stdin
    holds an assignment (or its end); False: this is a forked spare, whose stdin, stdout, stderr
    and status fd are its own now, and which waits on its stdin as any spare does."""
    sock = socket.socket(fileno=sock_fd)
    watched, refuse = [stdin_fd, wake_fd], None
    try:
        while True:
            ready = select.select(watched, [], [])[0]
            if stdin_fd in ready:
                return True
            if wake_fd in ready:  # the import is over: requests are served from now on
                loader.join()
                if loader.native_id is not None and not thread_gone(loader.native_id):
                    refuse = (f"the warm-up's thread (tid {loader.native_id}) still runs {THREAD_EXIT_WAIT_S:g} s "
                              "after its end: no fork")
                watched = [stdin_fd, sock]
                continue
            done = _answer(sock, refuse)
            if done == "spare":
                return False
            if done == "closed":  # the supervisor asks this one for no more spares
                watched = [stdin_fd]
    finally:
        _close(wake_fd)
        sock.close()


def _answer(sock: socket.socket, refuse: str | None = None) -> str:
    """One request read and answered (`served`); `closed`: the supervisor closed its end; `spare`:
    this is the spare just forked. `refuse`: why no request is to be served (each is answered so)."""
    try:
        message, fds, _, _ = socket.recv_fds(sock, 64, 4)
    except OSError:
        message, fds = b"", []
    if not message:
        for fd in fds:
            _close(fd)
        return "closed"
    if message != b"fork" or len(fds) != 4:
        reply = {"error": f"not a fork request: {message[:32]!r} with {len(fds)} fd(s)"}
    elif refuse is not None:
        reply = {"error": refuse}
    elif threading.active_count() > 1:
        reply = {"error": f"the source runs {threading.active_count()} Python threads: no fork"}
    elif cuda_driver_loaded():
        reply = {"error": "the source loaded the CUDA driver: a fork of it could not use CUDA"}
    else:
        pid = _fork_spare(sock, fds)
        if pid is None:
            return "spare"
        reply = {"pid": pid} if pid > 0 else {"error": "fork failed"}
    for fd in fds:
        _close(fd)
    try:
        sock.send(json.dumps(reply).encode())
    except OSError:
        pass
    return "served"


def thread_gone(tid: int, wait_s: float = THREAD_EXIT_WAIT_S) -> bool:
    """Thread `tid` of this process has left the kernel's thread list (/proc/self/task), waited for
    up to `wait_s`: a joined thread may still be running its C-level exit (the module's docstring)."""
    deadline = time.monotonic() + wait_s
    while os.path.exists(f"/proc/self/task/{tid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def cuda_driver_loaded(maps: str = "/proc/self/maps") -> bool:
    """libcuda is mapped: something initialized the CUDA driver here, which a forked child cannot
    use (a spare is forked before CUDA is touched: the assignment says which GPU)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def _fork_spare(sock: socket.socket, fds: list[int]) -> int | None:
    """Fork the spare through a middle process; its pid (-1: a fork failed) in the source, None in
    the spare itself."""
    pid_r, pid_w = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        _close(pid_r)
        _close(pid_w)
        return -1
    if middle == 0:
        try:
            spare = os.fork()
        except OSError:
            os._exit(1)
        if spare == 0:
            _become_spare(sock, fds, (pid_r, pid_w))
            return None
        os.write(pid_w, str(spare).encode())
        os._exit(0)
    _close(pid_w)
    os.waitpid(middle, 0)  # reaped: the spare is the supervisor's child from here on
    said = os.read(pid_r, 32)
    _close(pid_r)
    return int(said) if said else -1


def _become_spare(sock: socket.socket, fds: list[int], close: tuple[int, ...]) -> None:
    """In the forked spare: a session of its own, the four fds as its stdin, stdout, stderr and status
    fd (the number its environment names), nothing of the source's kept, and the supervisor's death
    its own."""
    os.setsid()
    stdin, stdout, stderr, status = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    status_fd = os.environ.get(STATUS_FD)
    if status_fd is not None:
        os.dup2(status, int(status_fd))
    sock.close()  # its fd and the wake-up pipe's are closed by `serve` on its way out
    for fd in (*fds, *close):
        _close(fd)
    _die_with_supervisor(os.environ.get(SUPERVISOR_PID))


def _die_with_supervisor(supervisor: str | None, wait_s: float = REPARENT_WAIT_S) -> None:
    """Once reparented to the supervisor (the middle process exits at once), PR_SET_PDEATHSIG:
    SIGKILL when it ends. Never reparented to it (it is no subreaper, or it is gone): exit."""
    if not supervisor:
        return
    deadline = time.monotonic() + wait_s
    while os.getppid() != int(supervisor):
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.001)
    prctl = _prctl()
    if prctl is not None:
        import signal

        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != int(supervisor):
            os._exit(1)


def _prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return prctl


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
