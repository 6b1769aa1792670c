"""A checkpoint written by a forked child process while the loop trains on.

A writer *thread* shares the interpreter with the training loop: pickling the state holds
the GIL the loop needs between its operations, and on a host whose cores training keeps
busy (CPU training, or a data pipeline) the two slow each other down by more than the write
costs when it simply blocks. A child forked right after the state was copied to host memory
has its own interpreter and sees that copy as it was (copy-on-write, nothing is sent), runs
at a lower CPU priority, and reports back through a pipe: the path it published, or the
failure with its exit code. torch.distributed.checkpoint's process-based `async_save` writes
from another process for the same reason.

The child only writes files: it makes no CUDA call (it cannot: a forked child has no usable
CUDA context; the staged copy is in host memory), takes no stop signal (the loop decides
whether a write in flight may finish; the teardown's SIGKILL to the process group ends it),
dies with the thread that forked it (PR_SET_PDEATHSIG), and leaves by `os._exit`, so none of
the parent's atexit callbacks, buffers or destructors run twice. Sharded checkpoints (FSDP)
stay in a thread: every rank's writer joins DCP's collectives there.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable
from pathlib import Path

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.parent_death import die_with_parent

WRITER_NICE = 10  # below the loop: where training keeps every core busy, the write takes what is left


class WriterError(GpuherdError, RuntimeError):
    """The child's failure, raised in the loop: its message and exit code as the child had them."""


def write_in_child(work: Callable[[], Path], step: int, started: Callable[[int], None] = lambda pid: None) -> Path:
    """Fork; the child runs `work` (it returns the published path) and exits. Blocks the calling
    thread (not the loop: worker/checkpoint_writer.py calls it from its thread) until then.
    `started(pid)`: told the child's pid (a loop waiting for a stuck writer names it)."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(work, write_fd, parent)  # never returns
    os.close(write_fd)
    started(pid)
    with os.fdopen(read_fd, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    return _outcome(report, status, pid, step)


def _child(work: Callable[[], Path], out: int, parent: int) -> None:
    code = 0
    try:
        _deaf_and_low(parent)
        report = ("published", str(work()))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the loop, in words
        code = 1
        exit_code = exc.exit_code if isinstance(exc, GpuherdError) else None
        report = ("failed", f"{type(exc).__name__}: {exc}" if exit_code is None else str(exc), exit_code)
    try:
        data = memoryview(pickle.dumps(report))
        while data:  # a long message may not fit the pipe in one write
            data = data[os.write(out, data):]
    finally:
        os._exit(code)


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


def _outcome(report: bytes, status: int, pid: int, step: int) -> Path:
    if report:
        kind, *rest = pickle.loads(report)  # noqa: S301 - our own child's three plain values
        if kind == "published":
            return Path(rest[0])
        message, exit_code = rest
        raise WriterError(message, ExitCode.FAILURE if exit_code is None else exit_code)
    if os.WIFSIGNALED(status):
        ended = f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
    else:
        ended = f"exited with code {os.waitstatus_to_exitcode(status)}"
    raise WriterError(f"the checkpoint writer process (pid {pid}) {ended} before it published the checkpoint of "
                      f"step {step}: it stays invisible to --resume", ExitCode.FAILURE)
