"""Small text conversions every package shares: comma-separated ids in, durations out."""

from __future__ import annotations


def int_list(text: str) -> list[int]:
    """`"0,2"` -> `[0, 2]`; empty items are skipped. Raises ValueError on a non-integer,
    which each caller turns into its own one-line message."""
    return [int(part) for part in text.split(",") if part.strip()]


def format_duration(seconds: float) -> str:
    """`5:30`, or `1:02:03` beyond an hour: the ETA format of the step and build lines."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
