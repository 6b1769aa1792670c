"""`logs/<run-id>/metrics.jsonl`: every status record of every worker plus the
supervisor's own records (GPU samples, restarts), one JSON object per line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from gpuherd.log_writes import LOG_WRITES
from gpuherd.status_records import Record, to_object


class MetricsSink:
    """`metrics.jsonl`, appended from the loop and from watcher threads alike: each record
    is one O_APPEND write, so lines never tear or interleave."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = LOG_WRITES.open(path)  # never through a planted symlink; None: its disk refused it

    def write_lines(self, data: bytes) -> None:
        if data:
            LOG_WRITES.write(self._fd, data, self.path)  # a full log disk drops records (counted), never the run

    def write(self, record: Record | dict[str, Any]) -> None:
        """A declared record (gpuherd/status_records.py), or a dict for the types not declared there."""
        obj = to_object(record) if isinstance(record, Record) else record
        self.write_lines(orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
