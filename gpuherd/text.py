"""Small text conversions every package shares: comma-separated ids in, durations out,
strings that hold undecodable bytes made printable, and the "did you mean" hint a message
about a mistyped name ends with."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


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


def has_undecodable(text: str) -> bool:
    """True when `text` carries bytes that were not UTF-8 (Python keeps them as lone
    surrogates: a file name in another encoding, or any non-ASCII one under a non-UTF-8
    locale); JSON writers refuse such strings."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def printable(text: str) -> str:
    """`text` with each undecodable byte shown as `\\xNN` (the bytes a file name really has)."""
    if not has_undecodable(text):
        return text
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that never was a byte (e.g. from a JSON escape)
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: str) -> str:
    """`printable(text)` with every control character shown as its escape (`\\n`, `\\x00`): a
    refusal quoting what the user gave (a --run-id with a newline, a config key with a NUL)
    stays the one line it promises, and no terminal is handed a raw control byte."""
    shown = printable(text)
    if shown.isprintable():
        return shown
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in shown)


def printable_tree(value: Any) -> Any:
    """Every string in nested dicts/lists made `printable`: a record that must be written
    (summary.json, metadata.json) whatever file names it quotes."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_tree(k): printable_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_tree(v) for v in value]
    return value


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest choice, or "" when none is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
