"""Append-only binary array file that hashes what it writes as it goes, so the
checksum of a multi-GB token file costs no second read at build time."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class FileRecord:
    bytes: int
    sha256: str

    def as_dict(self) -> dict[str, object]:
        return {"bytes": self.bytes, "sha256": self.sha256}


class ArrayWriter:
    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self.count = 0  # items written
        self._digest = hashlib.sha256()
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())

    def append(self, values: np.ndarray) -> None:
        array = np.ascontiguousarray(values, dtype=self.dtype)
        view = memoryview(array).cast("B")
        self._file.write(view)
        self._digest.update(view)
        self.count += array.size

    def close(self) -> FileRecord:
        """Flush and fsync: the data is on disk before metadata.json names it."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return FileRecord(bytes=self.count * self.dtype.itemsize, sha256=self._digest.hexdigest())

    def abort(self) -> None:
        self._file.close()
