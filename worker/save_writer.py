"""The checkpoint writer: one child process per rank that writes one-file checkpoints,
forked once when the saver starts and kept for the whole run.

Why a process: a writer *thread* shares the interpreter with the training loop, and
torch.save's pickling holds the GIL the loop needs between its operations. Why one for the
whole run, and not a fork per save: a fork taken right after a save shares every page of
the live state with its child, so each page the next step rewrites (every parameter, every
optimizer moment, the allocator's arenas) is copied by a page fault in the loop, hundreds
of MB of faults per save on a CPU run; forked before training, that is paid once, in the
first step, and the child holds no more than the state as it was then.

Each save's tensors reach the writer through shared memory (worker/save_snapshot.py: the
loop copies them into a buffer mapped before the fork, so both see it), its other values as
a small pickle over a Unix socket. The writer answers with the path it published, or the
failure with its exit code. It runs at the lowest CPU priority (nice 19): where training keeps every core busy it takes the cycles
training leaves (the waits in collectives, the data loading), so its work is not the
loop's; on an idle CPU (a GPU run) it changes nothing.

The child only writes files: it makes no CUDA call (a forked child has no usable CUDA
context; the snapshot is in host memory), takes no stop signal (the loop decides whether a
write in flight may finish; the teardown's SIGKILL to the process group ends it), dies with
the loop (PR_SET_PDEATHSIG), exits when the loop closes its socket, and leaves by
`os._exit`, so none of the loop's atexit callbacks, buffers or destructors run twice.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.parent_death import die_with_parent
from worker.checkpoint_writer import Written
from worker.save_snapshot import Snapshot

WRITER_NICE = 19  # the lowest priority: the write takes what training leaves of the cores
CLOSE_WAIT_S = 5.0  # a writer told to leave exits at once; this only bounds an unscheduled one
_LENGTH = struct.Struct("!Q")


class WriterError(GpuherdError, RuntimeError):
    """The writer's failure, raised in the loop: its message and exit code as the writer had them."""


Work = Callable[[Path, int, Snapshot], Path]  # in the writer: (path, step, the save's snapshot) -> published path


class WriterProcess:
    """The loop's handle on its writer (the calls come from one thread at a time)."""

    def __init__(self, work: Work, prepare: Callable[[], None] = lambda: None) -> None:
        """Forks now: call it before training, from the thread that lives as long as the run
        (PR_SET_PDEATHSIG follows the thread that forked). `prepare` runs first in the writer,
        at its low priority (backing the shared buffer with memory)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            _serve(theirs, work, prepare, parent)  # never returns
        theirs.close()
        self.pid, self._sock, self._exit_status = pid, ours, None

    def write(self, path: Path, step: int, snapshot: Snapshot) -> Written:
        """Hand one save to the writer and wait for its answer (from the saver's thread, not
        the loop): the published path and the writer's CPU seconds for it."""
        try:
            _send_frame(self._sock, pickle.dumps((str(path), step, snapshot), protocol=pickle.HIGHEST_PROTOCOL))
            report = _read_frame(self._sock)
        except OSError:
            report = None
        if report is None:
            raise self._died(step)
        kind, *rest = pickle.loads(report)  # noqa: S301 - our own child's plain values
        if kind == "published":
            return Written(Path(rest[0]), rest[1])
        message, exit_code = rest
        raise WriterError(message, ExitCode.FAILURE if exit_code is None else exit_code)

    def _died(self, step: int) -> WriterError:
        status = self._reap(block=True)
        if os.WIFSIGNALED(status):
            ended = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            ended = f"exited with code {os.waitstatus_to_exitcode(status)}"
        return WriterError(f"the checkpoint writer process (pid {self.pid}) {ended} before it published the "
                           f"checkpoint of step {step}: it stays invisible to --resume", ExitCode.FAILURE)

    def close(self) -> None:
        """Tell the writer to leave (it has nothing in flight: the saver waited) and reap it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self._reap(block=False) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._exit_status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reap(block=True)

    def _reap(self, block: bool) -> int | None:
        if self._exit_status is None:
            try:
                pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler): its status is gone
                pid, status = self.pid, 0
            if pid:
                self._exit_status = status
        return self._exit_status


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _read_frame(sock: socket.socket) -> bytes | None:
    head = _read_exact(sock, _LENGTH.size)
    return None if head is None else _read_exact(sock, _LENGTH.unpack(head)[0])


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


# --------------------------------------------------------------------------- the child


def _serve(sock: socket.socket, work: Work, prepare: Callable[[], None], parent: int) -> None:
    code = 0
    try:
        _deaf_and_low(parent)
        prepare()
        while (request := _read_frame(sock)) is not None:
            _send_frame(sock, pickle.dumps(_write_one(request, work)))
    except BaseException:  # noqa: BLE001 - the loop names a writer that is gone by its exit status
        code = 1
    finally:
        os._exit(code)


def _write_one(request: bytes, work: Work) -> tuple:
    cpu = time.process_time()  # the whole writer's, unpickling included
    try:
        path, step, snapshot = pickle.loads(request)  # noqa: S301 - the loop's own pickle
        published = work(Path(path), step, snapshot)
        return ("published", str(published), time.process_time() - cpu)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the loop, in words
        exit_code = exc.exit_code if isinstance(exc, GpuherdError) else None
        return ("failed", f"{type(exc).__name__}: {exc}" if exit_code is None else str(exc), exit_code)


def _deaf_and_low(parent: int) -> None:
    die_with_parent(parent)
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) or sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                                        signal.SIGUSR1, signal.SIGUSR2):
            try:
                signal.signal(sig, signal.SIG_IGN)  # the loop's handlers are not the writer's
            except (OSError, ValueError):
                pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE))
    except OSError:
        pass
