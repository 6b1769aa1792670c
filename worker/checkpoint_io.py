"""Checkpoint file primitives shared by the checkpointer and the engines: the three
formats, an atomic `torch.save` that checksums what it writes, a `torch.load` whose
failures are said in plain words, and publishing a sharded directory so that it
counts only once complete, manifest included (gpuherd/checkpoint_manifest.py)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from gpuherd.checkpoint_layout import META
from gpuherd.checkpoint_manifest import (
    FileDigest,
    HashingWriter,
    Manifest,
    file_digest,
    remove_manifest,
    write_manifest,
)
from gpuherd.exit_codes import ExitCode
from gpuherd.files import atomic_file, fsync_dir, locked_temp_dir
from gpuherd.storage import probe_errno, storage_errno
from worker import distributed as wdist
from worker import save_phases
from worker.direct_sink import DirectSink, page_aligned_records
from worker.distributed import WorkerError

FORMAT_FILE = "gpuherd/full-v1"
FORMAT_DCP = "gpuherd/dcp-v1"
FORMAT_DEEPSPEED = "gpuherd/deepspeed-v1"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format is a zip archive
_DIRECT = contextvars.ContextVar("gpuherd_direct_checkpoint_writes", default=False)


def run_label(meta: dict[str, Any]) -> str:
    """The run id that goes into the manifest and into temp names, so a leftover of a
    killed save says whose it was."""
    return str(meta.get("run_id") or "")


def manifest_of(meta: dict[str, Any], files: dict[str, FileDigest]) -> Manifest:
    return Manifest(run_id=run_label(meta), step=int(meta["step"]), files=files)


@contextlib.contextmanager
def directly_to_disk() -> Iterator[None]:
    """One-file checkpoints saved inside go through worker/direct_sink.py: for states whose
    tensors lie page-aligned in memory (the async saver's shared buffer), written to the disk
    without the page cache's copy and writeback."""
    token = _DIRECT.set(True)
    try:
        yield
    finally:
        _DIRECT.reset(token)


def atomic_torch_save(obj: Any, path: Path, label: str = "",
                      before_publish: Callable[[FileDigest], None] | None = None) -> FileDigest:
    """torch.save into a locked temp file renamed into place; the manifest's digest is taken from
    the bytes on their way to disk. `before_publish(digest)` runs between the fsync and
    the rename."""
    with atomic_file(path, label, None if before_publish is None else lambda: before_publish(writer.digest())) \
            as handle, _without_zip_crc32():
        if _DIRECT.get():
            with page_aligned_records():
                writer = DirectSink(handle.fileno())
                try:
                    torch.save(obj, writer)
                    writer.flush()  # torch.save flushed at its end already: a guard, costs nothing
                finally:
                    writer.close()
        else:
            writer = HashingWriter(handle)
            torch.save(obj, writer)
    return writer.digest()


@contextlib.contextmanager
def _without_zip_crc32():
    """torch.save's zip records carry a CRC32 each, which costs about 3 s of CPU per GB written
    (more than the rest of a save); the manifest's digest already vouches for every byte, and
    torch.load reads such files as any other. Torch's switch is global: restored after, and a
    concurrent save at worst computes the CRC it would have anyway."""
    switch = getattr(torch.serialization, "set_crc32_options", None)
    if switch is None:  # a torch without it writes the CRC
        yield
        return
    before = torch.serialization.get_crc32_options()
    switch(False)
    try:
        yield
    finally:
        switch(before)


def save_checkpoint_file(obj: dict[str, Any], path: Path) -> None:
    """A one-file checkpoint and its manifest. The old manifest goes first, and the new one
    is written before the file is renamed into place: a checkpoint name never shows
    without the manifest that vouches for its bytes (an interrupted overwrite leaves the
    old bytes under a manifest that refuses them: skipped, never mistaken)."""
    meta = obj["meta"]
    step = int(meta["step"])
    remove_manifest(path)

    def manifest(digest: FileDigest) -> None:
        save_phases.reached("written", step)
        write_manifest(path, manifest_of(meta, {path.name: digest}))
        save_phases.reached("manifest", step)

    atomic_torch_save(obj, path, run_label(meta), before_publish=manifest)
    save_phases.reached("published", step)


def load_file(path: Path) -> dict[str, Any]:
    """mmap=True: tensors are read from the page cache as they are copied into the model, so
    the ranks of one node share one copy of the file instead of each loading all of it."""
    problem = file_problem(path)
    if problem:
        raise WorkerError(problem, ExitCode.USAGE)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise WorkerError(f"cannot read checkpoint {path}: {' '.join(str(exc).split())[:200]}", ExitCode.USAGE) from None


def file_problem(path: Path) -> str | None:
    """What is wrong with a torch.save file, in the words a user needs (torch's own
    messages talk about zip internals and `weights_only`)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(len(_ZIP_MAGIC))
    except OSError as exc:
        return f"cannot read checkpoint {path}: {exc.strerror}"
    if size == 0:
        return f"checkpoint {path} is empty"
    if head != _ZIP_MAGIC:
        return f"{path} is not a gpuherd checkpoint"
    if not zipfile.is_zipfile(path):
        return f"checkpoint {path} is truncated (the end of the file is missing)"
    return None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta block of any checkpoint layout (used by resume and generate.py)."""
    if path.is_dir():
        if not (path / META).is_file():
            raise WorkerError(f"{path} is not a complete gpuherd checkpoint (no {META})", ExitCode.USAGE)
        meta = load_file(path / META)
    else:
        meta = load_file(path).get("meta")
    if not isinstance(meta, dict) or "step" not in meta:
        raise WorkerError(f"{path} is not a gpuherd checkpoint (no training state in it)", ExitCode.USAGE)
    return meta


def checkpoint_format(path: Path, meta: dict[str, Any]) -> str:
    """Which format `path` holds; single files predate the `format` key in meta."""
    return meta.get("format", FORMAT_FILE) if path.is_dir() else FORMAT_FILE


def publish_dir(path: Path, meta: dict[str, Any], rank: int, write_shards: Callable[[Path], None],
                group: Any = None) -> None:
    """A collective (over `group`, default the world): every rank writes its shards into one
    temp directory (rank 0 creates and locks it), the ranks checksum its files between them,
    then rank 0 adds `meta.pt` and the manifest and renames it to `path`, so a crash never
    leaves a complete-looking directory."""
    step = int(meta["step"])
    if rank != 0:
        tmp = Path(wdist.gather_objects(None, group)[0])
        write_shards(tmp)
        wdist.barrier(group)
        _checksums(tmp, rank, group)
        return
    with locked_temp_dir(path, run_label(meta)) as tmp:
        try:
            wdist.gather_objects(str(tmp), group)
            write_shards(tmp)
            wdist.barrier(group)  # every shard is on disk
            files = _checksums(tmp, rank, group)
            files[META] = atomic_torch_save(meta, tmp / META)
            save_phases.reached("written", step)
            write_manifest(tmp, manifest_of(meta, files))
            save_phases.reached("manifest", step)
        except Exception as exc:
            # DeepSpeed writes through torch's C++ writer, whose errors carry no errno:
            # ask the disk now, while the partial shards still fill it.
            code = storage_errno(exc) or probe_errno(path.parent)
            if code is None:
                raise
            raise OSError(code, os.strerror(code), str(path)) from exc
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    fsync_dir(path.parent)
    save_phases.reached("published", step)


def _checksums(tmp: Path, rank: int, group: Any = None) -> dict[str, FileDigest]:
    """A collective: rank 0 lists the directory, each rank hashes its share of the files."""
    listed = wdist.gather_objects(_files_under(tmp) if rank == 0 else None, group)
    names = listed[0]
    mine = {name: file_digest(tmp / name) for name in names[rank::len(listed)]}
    merged: dict[str, FileDigest] = {}
    for part in wdist.gather_objects(mine, group):
        merged.update(part)
    return merged


def _files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
