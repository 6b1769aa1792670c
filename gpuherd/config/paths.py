"""Paths a user typed are relative to where they ran the command."""

from __future__ import annotations

from pathlib import Path


def absolute(path: str | Path, cwd: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (cwd / p)
