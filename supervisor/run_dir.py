"""The run directory `logs/<run-id>/`: its id, its path, and its creation (atomic: one run per id)."""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import re
import secrets
import socket
from pathlib import Path

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunDirError(GpuherdError):
    """A bad --run-id or an existing run directory; one line for the user (exit 2)."""

    exit_code = ExitCode.USAGE


def new_run_id() -> str:
    """YYYYmmdd-HHMMSS-<4 hex>: sorts by time, unique for runs started in one second."""
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise RunDirError(f"--run-id '{run_id}' must be 1-128 characters of letters, digits, '.', '_' or '-' "
                          "(no '/'), starting with a letter or digit")
    return run_id


def run_dir_path(run_root: str | Path, run_id: str) -> Path:
    return Path(run_root) / run_id


def ensure_free(run_dir: Path, force: bool) -> None:
    """Refuse to mix two runs' logs unless asked to, and any symbolic link where the run writes
    (checked before anything is written)."""
    refuse_links(run_dir)
    if run_dir.exists() and not force:
        raise RunDirError(f"run directory {run_dir} already exists (choose another --run-id or add --force)")


def refuse_links(run_dir: Path) -> None:
    """Nothing is ever written outside the run directory: a run directory that is a symbolic
    link, or (reused with --force) holds one anywhere inside, is refused, never followed."""
    if run_dir.is_symlink():
        raise RunDirError(f"run directory {run_dir} is a symbolic link (to {os.readlink(run_dir)}): gpuherd never "
                          "writes through one; remove it or choose another --run-id")
    if not run_dir.is_dir():
        return
    for parent, dirs, files in os.walk(run_dir):  # followlinks=False: a linked directory is listed, not entered
        for name in sorted(dirs + files):
            entry = Path(parent) / name
            if entry.is_symlink():
                raise RunDirError(f"run directory {run_dir} holds a symbolic link, {entry} (to {os.readlink(entry)}): "
                                  "gpuherd never writes through one; remove it or choose another --run-id")


def create(run_dir: Path, exist_ok: bool = False) -> Path:
    """Make the directory in one `mkdir`: of two runs started at the same instant with one
    --run-id, exactly one gets it. (`ensure_free`, earlier, refuses the usual case before
    anything else is done; only this mkdir settles a race.)"""
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.mkdir(exist_ok=exist_ok)
        refuse_links(run_dir)  # planted since ensure_free: Path.mkdir(exist_ok=True) accepts a link to a directory
    except FileExistsError:
        raise RunDirError(f"run directory {run_dir} already exists: another run with this --run-id started "
                          "at the same moment (choose another --run-id)") from None
    except OSError as exc:
        raise RunDirError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from None
    return run_dir


def hold(run_dir: Path) -> int:
    """Take the run directory for this supervisor's life (an flock on `run.lock`, released by
    the kernel when the process ends, however it ends): a second start of the same run while
    one is still running (a SLURM script submitted twice) is refused instead of mixed in.
    Returns the descriptor, which must stay open; it is not inherited by the workers."""
    path = run_dir / "run.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)  # a full disk: the caller's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(f"run directory {run_dir} is in use by a start of this run that is still running "
                          f"({holder}); wait for it to end, or choose another --run-id") from None
    except OSError as exc:  # a filesystem without locks: the run goes on unguarded, as before
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise RunDirError(f"cannot lock {path}: {exc.strerror or exc}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd
