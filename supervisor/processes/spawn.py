"""Start one worker so that it can never outlive the supervisor.

Each worker gets its own session, and so its own process group (teardown signals
the whole group, so data-loader children go too), and PR_SET_PDEATHSIG(SIGKILL), set
in the forked child before exec. The death signal fires when the *thread* that forked the child
exits, which is why workers are spawned from the main thread only. A supervisor
that dies between fork and prctl would leave the child waiting for a signal that
never comes, so the child also checks its parent pid after prctl. Grandchildren do
not inherit the death signal; `orphan_guard` covers them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from gpuherd import parent_death
from supervisor.gpus import DeviceSlot

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)



def _load_libc() -> ctypes.CDLL:
    """glibc by its soname; find_library (which runs `ldconfig -p`, a process, on every import)
    only where that name is not there (musl)."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


_libc = _load_libc()
_signal = _libc.signal  # resolved now: the forked child must not load or look up anything
_signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
_signal.restype = ctypes.c_void_p
SIG_IGN = 1
HELPER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def become_subreaper() -> bool:
    """Orphaned grandchildren (double-forked, setsid) are reparented to us, not to
    init, so the end-of-run sweep still finds and kills them."""
    return parent_death.become_subreaper()


def die_with_parent(parent_pid: int | None = None):
    """preexec_fn for any child of the supervisor: SIGKILL when we die, even by SIGKILL."""
    parent_pid = os.getpid() if parent_pid is None else parent_pid

    def preexec() -> None:  # runs in the child between fork and exec: no imports, no locks
        parent_death.die_with_parent(parent_pid)
    return preexec


def helper_preexec(parent_pid: int | None = None):
    """preexec_fn for the supervisor's helpers (the job's node agent, the rendezvous store):
    `die_with_parent`, and deaf to stop signals (ignored dispositions survive exec). SLURM
    signals every process of a job step on scancel, a preemption or the time limit, and its
    `--signal` warning is SIGUSR1, whose default action is death: a helper that died of it
    would cut the node off from the job while its workers save. The supervisor ends them."""
    dies = die_with_parent(parent_pid)

    def preexec() -> None:
        for signum in HELPER_IGNORES:
            _signal(signum, SIG_IGN)
        dies()
    return preexec


@dataclass
class WorkerProcess:
    slot: DeviceSlot
    popen: subprocess.Popen
    status_fd: int  # read end of this worker's status pipe
    log_path: Path
    started: float  # time.monotonic() at spawn
    returncode: int | None = None
    ended: float | None = None
    signalled: list[str] = field(default_factory=list)  # what the supervisor sent, for the summary

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session: the worker leads its own group

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.popen.poll()
            if code is not None:
                self.returncode, self.ended = code, time.monotonic()
        return self.returncode

    def stopped(self) -> bool:
        """Stopped (SIGSTOP, SIGTSTP, a debugger's trace stop): it runs no handler, answers nothing."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return False
        return stat[stat.rindex(")") + 2:][:1] in ("T", "t")

    def signal_group(self, signum: int) -> None:
        """Signal the worker and everything it forked that stayed in its group."""
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        if self.alive:
            self.signalled.append(signal.Signals(signum).name)

    def signal_leader(self, signum: int) -> None:
        """Only the worker: SIGINT/SIGUSR1 would kill data-loader children that ignore them."""
        if self.alive:
            try:
                os.kill(self.pid, signum)
                self.signalled.append(signal.Signals(signum).name)
            except ProcessLookupError:
                pass

    def hand_over(self, slot: DeviceSlot, log_path: Path, env: Mapping[str, str], started: float) -> WorkerProcess:
        """A process waiting on its stdin (a warm spare, a restart standby) becomes the worker of
        `slot`: `env` as one JSON line (`{"env": {...}}`), then end of input; the same process, pipes
        and status channel. Raises OSError when it died meanwhile (its stdin pipe is broken)."""
        self.popen.stdin.write(orjson.dumps({"env": dict(env)}) + b"\n")
        self.popen.stdin.close()
        return WorkerProcess(slot=slot, popen=self.popen, status_fd=self.status_fd, log_path=log_path,
                             started=started)

    def discard(self, wait_s: float = 0.0) -> None:
        """End a process that waits on its stdin and was never handed a rank: end of input and
        `wait_s` to leave by itself, else SIGKILL; reaped (unless stuck in the kernel: the sweep
        and the orphan guard still cover it) and no fd of it left."""
        with contextlib.suppress(OSError):
            self.popen.stdin.close()
        try:
            self.popen.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
        for stream in (self.popen.stdout, self.popen.stderr):
            stream.close()
        with contextlib.suppress(OSError):
            os.close(self.status_fd)

    def handles(self, signums: tuple[int, ...]) -> frozenset[int]:
        """Which of `signums` the worker installed a handler for (SigCgt in /proc, read once)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("SigCgt:"):
                    mask = int(line.split()[1], 16)
                    return frozenset(s for s in signums if mask >> (s - 1) & 1)
        except (OSError, ValueError):
            pass
        return frozenset()


def widen_pipe(fd: int, size: int = 1 << 20) -> None:
    """1 MiB instead of 64 KiB: a burst of output never blocks a worker while we are busy."""
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, size)
    except OSError:  # above /proc/sys/fs/pipe-max-size: keep the default
        pass


def spawn(cmd: Sequence[str], env_for: Callable[[int], Mapping[str, str]], slot: DeviceSlot, log_path: Path,
          cwd: str | None = None, stdin_pipe: bool = False, keep_fds: Sequence[int] = ()) -> WorkerProcess:
    """Start `cmd`; `env_for(fd)` builds its environment once the status pipe's write
    end is known (the worker inherits it under the same fd number, via pass_fds).
    `stdin_pipe`: its stdin is a pipe the supervisor writes to (a warm spare's assignment);
    `keep_fds`: more fds it inherits under their numbers (a spare source's socket)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("workers must be spawned from the main thread (PR_SET_PDEATHSIG follows the thread)")
    status_r, status_w = os.pipe()
    try:
        popen = subprocess.Popen(
            list(cmd), env=dict(env_for(status_w)), cwd=cwd,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(status_w, *keep_fds),
            # A session, not just a group: with the kernel's autogroup scheduling (on by default) each
            # session shares the CPU as one, so workers in the supervisor's session would split one
            # share between them on a busy machine (torch's import took twice as long as under
            # torchrun, which starts each worker in a session of its own too).
            start_new_session=True, preexec_fn=die_with_parent(),
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)  # only the worker holds the write end: its death is our EOF
    for stream in (popen.stdout, popen.stderr):
        widen_pipe(stream.fileno())
        os.set_blocking(stream.fileno(), False)
    os.set_blocking(status_r, False)
    return WorkerProcess(slot=slot, popen=popen, status_fd=status_r, log_path=log_path, started=time.monotonic())
