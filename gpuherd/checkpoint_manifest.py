"""A checkpoint's manifest: which run wrote it, at which step, and the size and digest
of every file in it, written last (docs/design/checkpoints.md).

Torch-free, so the supervisor (and any tool) can tell whose checkpoint a file is
and whether it is whole without unpickling it:

- `step_0000100.pt` (one file): the manifest is `step_0000100.pt.manifest.json` beside it,
  written after the file was renamed into place (the old manifest is removed before a
  file is overwritten, so a manifest never vouches for other bytes);
- `step_0000100/` (a directory): `step_0000100/manifest.json`, written into the temp
  directory before it is renamed, so a published directory always carries one.

A checkpoint without a manifest was saved by an older gpuherd: it loads unverified.

The digest is xxh3-128 (format v2): it catches what a manifest is for, bytes that changed or
went missing after the save (a torn write, a bit flip, a truncated copy), at about 10 GB/s
per core, where sha256 (format v1) took 0.6 s of CPU per GB out of a training rank on every
save. It is no defence against someone who forges the bytes, and was never meant to be: the
manifest sits beside the file, writable by whoever can write the file. Manifests of format
v1 (sha256) still verify.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import xxhash

from gpuherd.files import write_bytes_atomic

FORMAT = "gpuherd/manifest-v2"
READABLE = {"gpuherd/manifest-v1": "sha256", FORMAT: "xxh3_128"}  # each format's one digest
DIGESTS: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}
DIGEST = READABLE[FORMAT]  # what this gpuherd writes
DIR_MANIFEST = "manifest.json"
FILE_SUFFIX = ".manifest.json"


@dataclass(frozen=True)
class FileDigest:
    size: int
    hexdigest: str
    algorithm: str = DIGEST


def new_hash(algorithm: str = DIGEST) -> Any:
    """A fresh hash object (update / hexdigest) of a manifest's digest algorithm."""
    return DIGESTS[algorithm]()


@dataclass(frozen=True)
class Manifest:
    run_id: str  # "" when the writer ran outside any named run
    step: int
    files: dict[str, FileDigest]  # relative to the checkpoint directory (a file: its own name)

    def to_json(self) -> bytes:
        """Every file's digest must be this gpuherd's (DIGEST): one format, one algorithm."""
        if any(d.algorithm != DIGEST for d in self.files.values()):
            raise ValueError(f"a {FORMAT} manifest holds {DIGEST} digests only")
        files = {name: {"bytes": d.size, DIGEST: d.hexdigest} for name, d in sorted(self.files.items())}
        return orjson.dumps({"format": FORMAT, "run_id": self.run_id, "step": self.step, "files": files},
                            option=orjson.OPT_INDENT_2) + b"\n"

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Raises ValueError (with the reason) when `data` is not a manifest."""
        try:
            raw = orjson.loads(data)
            algorithm = READABLE.get(raw.get("format"))
            if algorithm is None:
                raise ValueError(f"unknown format {raw.get('format')!r}")
            files = {str(k): FileDigest(int(v["bytes"]), str(v[algorithm]), algorithm)
                     for k, v in raw["files"].items()}
            return cls(run_id=str(raw.get("run_id") or ""), step=int(raw["step"]), files=files)
        except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed manifest ({type(exc).__name__})") from None


class HashingWriter:
    """A write-only stream that hashes and counts what passes through to `handle`, so a
    checkpoint's checksum costs no second read of what was just written."""

    def __init__(self, handle: Any) -> None:
        self._handle, self._hash, self._size = handle, new_hash(), 0

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self._size += len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()

    def digest(self) -> FileDigest:
        return FileDigest(self._size, self._hash.hexdigest())


def file_digest(path: Path, algorithm: str = DIGEST) -> FileDigest:
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, DIGESTS[algorithm]).hexdigest()
    return FileDigest(path.stat().st_size, digest, algorithm)


def manifest_path(checkpoint: Path) -> Path:
    if checkpoint.is_dir():
        return checkpoint / DIR_MANIFEST
    return checkpoint.with_name(checkpoint.name + FILE_SUFFIX)


def base_dir(checkpoint: Path) -> Path:
    """What the manifest's file names are relative to."""
    return checkpoint if checkpoint.is_dir() else checkpoint.parent


def write_manifest(checkpoint: Path, manifest: Manifest) -> None:
    write_bytes_atomic(manifest_path(checkpoint), manifest.to_json())


def remove_manifest(checkpoint: Path) -> None:
    checkpoint.with_name(checkpoint.name + FILE_SUFFIX).unlink(missing_ok=True)


def read_manifest(checkpoint: Path) -> Manifest | None:
    """The manifest, or None when the checkpoint has none (an older gpuherd wrote it).
    Raises ValueError naming the checkpoint when the manifest itself is unreadable."""
    path = manifest_path(checkpoint)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"checkpoint {checkpoint}: cannot read {path.name} ({exc.strerror})") from None
    try:
        return Manifest.from_json(data)
    except ValueError as exc:
        raise ValueError(f"checkpoint {checkpoint}: {path.name} is not a gpuherd manifest: {exc}") from None


def written_by(checkpoint: Path, run_id: str) -> bool:
    """Whether the checkpoint's manifest names `run_id` (cheap: nothing else is read). A
    checkpoint without one, or with an unreadable one, is nobody's: it is never taken for
    this run's (resumed as its own, or pruned)."""
    try:
        manifest = read_manifest(checkpoint)
    except ValueError:
        return False
    return manifest is not None and manifest.run_id == run_id


def size_problem(checkpoint: Path, manifest: Manifest) -> str | None:
    """Missing, empty or truncated files, in plain words (cheap: no file is read)."""
    base = base_dir(checkpoint)
    for name, want in sorted(manifest.files.items()):
        where = "" if name == checkpoint.name else f"{name}: "
        try:
            have = (base / name).stat().st_size
        except FileNotFoundError:
            return f"checkpoint {checkpoint} is incomplete ({name} is missing)"
        if have == 0 and want.size > 0:
            return f"checkpoint {checkpoint} is empty" + (f" ({name} has 0 bytes)" if where else "")
        if have < want.size:
            return f"checkpoint {checkpoint} is truncated ({where}{have} of {want.size} bytes)"
        if have > want.size:
            return f"checkpoint {checkpoint} has grown since it was saved ({where}{have} bytes, {want.size} recorded)"
    return None


def checksum_problem(checkpoint: Path, manifest: Manifest, names: Iterable[str]) -> str | None:
    """The first of `names` whose digest differs from the manifest's (reads each file once)."""
    base = base_dir(checkpoint)
    for name in names:
        want = manifest.files[name]
        try:
            digest = file_digest(base / name, want.algorithm)
        except OSError as exc:
            return f"checkpoint {checkpoint}: cannot read {name} ({exc.strerror})"
        if digest.hexdigest != want.hexdigest:
            what = "" if name == checkpoint.name else f" in {name}"
            return f"checkpoint {checkpoint}: checksum mismatch{what} (its bytes changed after it was saved)"
    return None
