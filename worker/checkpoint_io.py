"""Checkpoint file primitives shared by the checkpointer and the engines: the three
formats, an atomic `torch.save`, a safe `torch.load`, and publishing a sharded
directory so that it counts only once complete."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gpuherd.checkpoint_layout import META
from gpuherd.exit_codes import ExitCode
from gpuherd.files import atomic_file, fsync_dir
from worker import distributed as wdist
from worker.distributed import WorkerError

FORMAT_FILE = "gpuherd/full-v1"
FORMAT_DCP = "gpuherd/dcp-v1"
FORMAT_DEEPSPEED = "gpuherd/deepspeed-v1"


def atomic_torch_save(obj: Any, path: Path) -> None:
    with atomic_file(path) as handle:
        torch.save(obj, handle)


def load_file(path: Path) -> dict[str, Any]:
    """mmap=True: tensors are read from the page cache as they are copied into the model, so
    the ranks of one node share one copy of the file instead of each loading all of it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise WorkerError(f"cannot read checkpoint {path}: {' '.join(str(exc).split())[:200]}", ExitCode.USAGE) from None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta block of any checkpoint layout (used by resume and generate.py)."""
    if path.is_dir():
        if not (path / META).is_file():
            raise WorkerError(f"{path} is not a complete gpuherd checkpoint (no {META})", ExitCode.USAGE)
        return load_file(path / META)
    return load_file(path)["meta"]


def checkpoint_format(path: Path, meta: dict[str, Any]) -> str:
    """Which format `path` holds; single files predate the `format` key in meta."""
    return meta.get("format", FORMAT_FILE) if path.is_dir() else FORMAT_FILE


def publish_dir(path: Path, meta: dict[str, Any], rank: int, write_shards: Callable[[Path], None]) -> None:
    """A collective: every rank writes its shards into `<path>.tmp`, then rank 0 adds
    `meta.pt` and renames it to `path`, so a crash never leaves a complete-looking directory."""
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    wdist.barrier()
    write_shards(tmp)
    wdist.barrier()  # every shard is on disk
    if rank == 0:
        atomic_torch_save(meta, tmp / META)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_dir(path.parent)
