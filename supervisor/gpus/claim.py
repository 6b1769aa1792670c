"""Per-GPU claim locks: two gpuherd runs never take the same GPU.

A claim is an `fcntl.flock` on `<lock dir>/<uuid>.lock`, held by an open file
description. The kernel drops it when the last process holding that
description exits, however it exits (even SIGKILL), so a crashed run never
leaves a stale claim. Selection tries the lock of its best candidate, then the
next, so two auto-selecting jobs started in the same instant end up on
different GPUs (the race Lightning's auto_select_gpus had, PR #16147).

Across exec: `train_auto_gpu.sh` claims in the selector, marks the fd
inheritable and names it in GPUHERD_GPU_CLAIM_FDS (`uuid=fd,...`), then execs
`train_gpu.sh` -> `python -m supervisor`. The supervisor's `plan_gpus` adopts
that fd (it is the same lock) instead of seeing its own GPU as claimed, and
removes the variable so workers do not inherit it. Explicit runs
(`train_gpu.sh N`, `run_training.sh`) are claimed by `plan_gpus` itself.

The directory is shared by all users (mode 1777, like /tmp); override it with
GPUHERD_LOCK_DIR (tests, or a node-local path on shared /tmp setups).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from gpuherd.files import lock_or_close, try_flock

LOCK_DIR_ENV = "GPUHERD_LOCK_DIR"
CLAIM_FDS_ENV = "GPUHERD_GPU_CLAIM_FDS"
DEFAULT_LOCK_DIR = "/tmp/gpuherd-gpu-locks"


def lock_dir() -> Path:
    return Path(os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR)


def lock_path(uuid: str, directory: Path | None = None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", uuid) or "unknown"
    return (directory or lock_dir()) / f"{safe}.lock"


@dataclass
class GpuClaim:
    uuid: str
    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing our only descriptor drops the flock
            self.fd = -1

    def __del__(self) -> None:  # a claim nobody references any more is released, not leaked
        self.release()

    def make_inheritable(self) -> str:
        """Keep the claim across exec; returns this claim's GPUHERD_GPU_CLAIM_FDS entry."""
        os.set_inheritable(self.fd, True)
        return f"{self.uuid}={self.fd}"


def _open(path: Path) -> int:
    """Open without O_CREAT first: Linux's protected_regular forbids O_CREAT on another
    user's file in a sticky directory. flock needs no write access, so read-only will do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.chmod(path.parent, 0o1777)  # let other users' runs take and test claims too
    except OSError:
        pass  # not our directory: its owner already chose
    for flags in (os.O_RDWR, os.O_RDONLY):
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError:
            break
        except PermissionError:
            continue
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        os.fchmod(fd, 0o666)  # umask would keep other users out
        return fd
    except FileExistsError:  # another run created it a moment ago
        return _open(path)


def try_claim(uuid: str, directory: Path | None = None) -> GpuClaim | None:
    """Claim a GPU now, or None when another live process holds it."""
    path = lock_path(uuid, directory)
    fd = lock_or_close(_open(path))
    if fd is None:
        return None
    try:  # who holds it, for the "claimed by" message of the next run
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {time.time():.0f}\n".encode(), 0)
    except OSError:
        pass  # read-only descriptor: the claim holds, only the note is missing
    return GpuClaim(uuid, path, fd)


def claim_holder(uuid: str, directory: Path | None = None) -> int | None:
    """The pid holding a claim on this GPU (0 if unknown), or None when unclaimed."""
    path = lock_path(uuid, directory)
    if not path.exists():
        return None
    fd = _open(path)
    try:
        if try_flock(fd, shared=True):
            return None
        note = os.pread(fd, 64, 0).split()
        return int(note[0]) if note and note[0].isdigit() else 0
    finally:
        os.close(fd)  # also drops our probe lock


def inherited_claims(env: dict[str, str] | None = None, directory: Path | None = None) -> dict[str, GpuClaim]:
    """Claims a parent passed down through exec (GPUHERD_GPU_CLAIM_FDS), verified to be
    open descriptors of the right lock files; anything else is ignored."""
    raw = (os.environ if env is None else env).get(CLAIM_FDS_ENV, "")
    found: dict[str, GpuClaim] = {}
    for item in filter(None, raw.split(",")):
        uuid, _, fd_text = item.partition("=")
        if not fd_text.isdigit():
            continue
        fd, path = int(fd_text), lock_path(uuid, directory)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            continue
        if same:
            os.set_inheritable(fd, False)  # the workers must not hold the claim
            found[uuid] = GpuClaim(uuid, path, fd)
    return found
