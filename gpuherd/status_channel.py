"""The structured status channel: worker -> supervisor heartbeats as orjson lines.

The worker writes one JSON object per line to the pipe whose write end the
supervisor passed as fd `GPUHERD_STATUS_FD`. Each record is one `os.write` of
less than PIPE_BUF bytes, so records from one worker never tear. Every record
carries `type`, `rank` and `time`; the types and their fields are declared in
gpuherd/status_records.py (which also decodes them, on the supervisor's side) and listed in
docs/reference/status-records.md.

The writer needs only the standard library: a user's script may run in another interpreter
(torchrun's PYTHON_EXEC) that has torch but none of gpuherd's dependencies, and the script
bootstrap sends its heartbeats from there. orjson is used where it is installed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from gpuherd import contract
from gpuherd.status_records import RECORD_TYPES

try:
    import orjson
except ImportError:  # a script's own interpreter (PYTHON_EXEC): json writes the same records
    orjson = None  # type: ignore[assignment]

PIPE_BUF = 4096


class StatusWriter:
    """Worker side. Without a supervisor (standalone runs) every send is a no-op."""

    # True once a writer other than the script bootstrap's automatic heartbeat sent a record
    # in this process: the script reports for itself, and the automatic step counts (another
    # numbering of steps) must not interleave with its own (worker/script_bootstrap.py).
    explicit_records = False
    # True once something in the process numbers the steps itself (a script's live session,
    # gpuherd/live/): the bootstrap's heartbeat then sends no `step` record of its own count.
    explicit_steps = False

    def __init__(self, fd: int | None, rank: int, automatic: bool = False) -> None:
        self._fd = fd
        self._rank = rank
        self._automatic = automatic

    @classmethod
    def from_env(cls, rank: int, automatic: bool = False) -> StatusWriter:
        raw = os.environ.get(contract.STATUS_FD)
        return cls(int(raw) if raw else None, rank, automatic)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def connected(self) -> bool:
        return self._fd is not None

    def send(self, type_: str, *, at: float | None = None, **fields: Any) -> None:
        """`at`: the record's `time` (time.time()) as the sender read it, beside a reading of
        another clock at the same moment (worker/save_cost.py); default: now."""
        if self._fd is None:
            return
        if type_ not in RECORD_TYPES:
            raise ValueError(f"unknown status record type {type_!r}")
        if not self._automatic:
            StatusWriter.explicit_records = True
        record = {"type": type_, "rank": self._rank, "time": time.time() if at is None else at, **fields}
        line = encode(record)
        if len(line) > PIPE_BUF:  # keep writes atomic: drop bulky fields, never tear
            line = encode({"type": type_, "rank": self._rank, "time": record["time"], "truncated": True})
        try:
            os.write(self._fd, line)
        except (BrokenPipeError, OSError):
            # The supervisor is gone; the parent-death signal will end us. Stop writing.
            self._fd = None


def encode(record: dict[str, Any]) -> bytes:
    """One record as one line; numpy scalars and arrays as plain numbers and lists."""
    if orjson is not None:
        return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    return json.dumps(record, separators=(",", ":"), default=_plain).encode() + b"\n"


def _plain(value: Any) -> Any:
    """json's fallback for what orjson's OPT_SERIALIZE_NUMPY writes (numpy, torch scalars)."""
    for convert in ("tolist", "item"):
        if hasattr(value, convert):
            return getattr(value, convert)()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
