"""Shared by the end-to-end runs: reading a run's files while it runs."""

from __future__ import annotations

import orjson


def records(run_dir, kind: str) -> list[dict]:
    """Every `kind` record of the run's metrics.jsonl so far (a line being written is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line being written right now
        if record.get("type") == kind:
            out.append(record)
    return out
