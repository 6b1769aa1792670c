"""Directories the run will write into, checked before anything is written.

A path component longer than the filesystem allows, a regular file where a directory
must be (the path itself or one of its parents), or a directory nobody may create
files in would otherwise surface late: as a traceback after the run folder exists, or
at the first save after hours of training. Each becomes one line naming the config
key and the path.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from gpuherd.errors import LaunchError

DEFAULT_NAME_MAX = 255  # bytes per component on every common Linux filesystem
DEFAULT_PATH_MAX = 4096


def nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (what `mkdir -p` would start from)."""
    for candidate in (path, *path.parents):
        try:
            candidate.stat()
            return candidate
        except OSError as exc:  # ENOTDIR: a file further up, found on the way
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP):
                raise LaunchError(f"cannot look at {candidate}: {exc.strerror}") from None
    return Path(path.anchor or "/")


def check_directory(key: str, path: Path) -> Path:
    """`path` can be (or is) a directory; returns its nearest existing ancestor, itself a directory."""
    existing = nearest_existing(path)
    _check_lengths(key, path, existing)
    if not existing.is_dir():
        what = "a file" if existing.is_file() else "something else"
        where = f"{path} is" if existing == path else f"{path}: {existing} is"
        raise LaunchError(f"{key} {where} {what}, not a directory")
    return existing


def _check_lengths(key: str, path: Path, existing: Path) -> None:
    name_max = _pathconf(existing, "PC_NAME_MAX", DEFAULT_NAME_MAX)
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            shown = part if len(part) <= 40 else f"{part[:18]}...{part[-18:]}"
            raise LaunchError(f"{key}: the path component '{shown}' ({len(os.fsencode(part))} bytes) is longer "
                                 f"than the filesystem allows ({name_max})")
    path_max = _pathconf(existing, "PC_PATH_MAX", DEFAULT_PATH_MAX)
    # room for what the run puts below it: <run-id>/attempt-N/worker-rankR-GPUn.log and the like
    if len(os.fsencode(str(path))) + 256 > path_max:
        raise LaunchError(f"{key}: the path {str(path)[:60]}... ({len(os.fsencode(str(path)))} bytes) leaves no "
                             f"room below it for the run's files (the limit is {path_max})")


def _pathconf(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def probe_writable(key: str, path: Path, existing: Path) -> None:
    """Create and remove a file where the run will: permissions, a read-only mount and ACLs
    all answer here (os.access guesses wrong on NFS with root squashing, for one)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".gpuherd-probe-", dir=existing)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        where = path if existing == path else f"{path} (it would be created in {existing})"
        raise LaunchError(f"{key} {where}: cannot create files there ({exc.strerror})") from None
