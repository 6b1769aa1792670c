"""The checkpoint directory's layout, readable without torch (docs/reference/file-layouts.md).

The worker writes checkpoints (worker/checkpoint.py); the supervisor only needs to
know which complete ones exist, to tell a restarted attempt where to resume. Both
read the layout from here:

- `step_0000100.pt`: one file (single / ddp / zero1), complete once it exists (it is
  written under a temporary name and renamed);
- `step_0000100/`: a directory (fsdp, deepspeed), complete once `meta.pt` exists
  (written last).

Each may carry a manifest (gpuherd/checkpoint_manifest.py). A save in progress is a
hidden temp file or directory `.step_0000100[.pt].<run-id>.<pid>.<random>.tmp`
(gpuherd.files.atomic_file's naming), flock-held by its writer until the rename;
`remove_orphans` deletes the ones whose writer is gone.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import psutil

from gpuherd.checkpoint_manifest import remove_manifest
from gpuherd.files import held_by_nobody

META = "meta.pt"
_NAME = re.compile(r"^step_(\d{7})(\.pt)?$")
# Temp names of checkpoint saves: this version's (with the writer's pid) and older
# versions' (`.step_N.pt.<random>.tmp` files, `step_N.tmp` directories). NaN-stop
# checkpoints (`nan_*`) are saved the same way.
_TEMP = re.compile(r"^\.(step_\d{7}|nan_\w+?)(\.pt)?\..*\.tmp$|^step_\d{7}\.tmp$")
_TEMP_PID = re.compile(r"\.(\d+)\.[0-9a-f]{8}\.tmp$")


def checkpoint_name(step: int, sharded: bool) -> str:
    return f"step_{step:07d}" + ("" if sharded else ".pt")


def is_complete(path: Path) -> bool:
    return path.is_file() if path.suffix == ".pt" else (path / META).is_file()


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Complete `step_*` checkpoints, oldest first (NaN-stop checkpoints are not listed)."""
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def fingerprint(path: Path) -> tuple[int, int, int]:
    """(inode, mtime, size) of what makes `path` complete (the file, or a directory's META): a
    checkpoint rewritten under the same name (another run's step_0000100 saved over this
    one's) gets a new fingerprint, even where the filesystem reuses the inode at once and
    its clock ticks coarsely."""
    st = (path / META if path.is_dir() else path).stat()
    return st.st_ino, st.st_mtime_ns, st.st_size


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint (file + its manifest, or directory): manifest first, so an
    interruption leaves an unverified checkpoint rather than a manifest of nothing."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        remove_manifest(path)
        path.unlink(missing_ok=True)


def remove_orphans(directory: Path) -> list[tuple[Path, int]]:
    """Delete the temp files and directories of saves whose writer is gone (killed
    mid-save); returns (path, bytes) of each. A temp whose writer still holds its lock,
    or whose pid is alive on this host (just created, lock not yet taken), is kept: it
    is a live save, maybe another run's."""
    removed = []
    if not directory.is_dir():
        return removed
    for entry in directory.iterdir():
        if not _TEMP.match(entry.name) or not _writer_gone(entry):
            continue
        size = _size(entry)
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append((entry, size))
    return removed


def _writer_gone(path: Path) -> bool:
    pid = _TEMP_PID.search(path.name)
    if pid and psutil.pid_exists(int(pid.group(1))):
        return False
    return held_by_nobody(path)


def _size(path: Path) -> int:
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0
