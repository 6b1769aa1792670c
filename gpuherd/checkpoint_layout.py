"""The checkpoint directory's layout, readable without torch (docs/architecture.md, "File layouts").

The worker writes checkpoints (worker/checkpoint.py); the supervisor only needs to
know which complete ones exist, to tell a restarted attempt where to resume. Both
read the layout from here:

- `step_0000100.pt`: one file (single / ddp / zero1), complete once it exists (it is
  written under a temporary name and renamed);
- `step_0000100/`: a directory (fsdp, deepspeed), complete once `meta.pt` exists
  (written last).
"""

from __future__ import annotations

import re
from pathlib import Path

META = "meta.pt"
_NAME = re.compile(r"^step_(\d{7})(\.pt)?$")


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
