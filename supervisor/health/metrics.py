"""`logs/<run-id>/metrics.jsonl`: every status record of every worker plus the
supervisor's own records (GPU samples, restarts), one JSON object per line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from gpuherd.files import open_log


class MetricsSink:
    """`metrics.jsonl`, appended from the loop and from watcher threads alike: each record
    is one O_APPEND write, so lines never tear or interleave."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = open_log(path)  # never through a planted symlink

    def write_lines(self, data: bytes) -> None:
        if data:
            os.write(self._fd, data)

    def write(self, record: dict[str, Any]) -> None:
        self.write_lines(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    def close(self) -> None:
        os.close(self._fd)
