"""Bytes from a worker's pipe -> whole lines, with partial lines and `\\r` handled.

A line is only ever emitted whole, so prefixing it and writing it with one call
keeps lines from different workers from interleaving. Progress bars redraw with
`\\r` and no newline for minutes; their latest state is emitted at most once per
`progress_interval`, and the final state when the newline comes, so the log shows
progress without thousands of redraws. A pathologically long line is cut at
`max_line` bytes rather than held in memory.
"""

from __future__ import annotations

import re


class LineSplitter:
    def __init__(self, max_line: int = 64 * 1024, progress_interval: float = 1.0) -> None:
        self._pending = b""
        self._max_line = max_line
        self._progress_interval = progress_interval
        self._last_progress = float("-inf")

    def feed(self, data: bytes, now: float) -> list[bytes]:
        buf = self._pending + data if self._pending else data
        if b"\r" in buf:
            return self._feed_with_cr(buf, now)
        lines = buf.split(b"\n")
        self._pending = lines.pop()
        if len(self._pending) > self._max_line:
            lines.append(self._pending)
            self._pending = b""
        return lines

    def finish(self) -> list[bytes]:
        """End of stream: a last line without newline (a crash mid-line) is kept, not lost."""
        rest, self._pending = self._pending, b""
        rest = _last_state(rest)
        return [rest] if rest else []

    def _feed_with_cr(self, buf: bytes, now: float) -> list[bytes]:
        if buf.endswith(b"\r"):  # maybe the first half of \r\n: decide when the next byte comes
            buf, hold = buf[:-1], b"\r"
        else:
            hold = b""
        buf = buf.replace(b"\r\n", b"\n")
        parts = buf.split(b"\n")
        pending = parts.pop()
        lines = [_last_state(p) if b"\r" in p else p for p in parts]
        if b"\r" in pending:
            shown, _, pending = pending.rpartition(b"\r")
            state = _last_state(shown)
            if state and now - self._last_progress >= self._progress_interval:
                lines.append(state)
                self._last_progress = now
        self._pending = pending + hold
        if len(self._pending) > self._max_line:
            lines.append(self._pending)
            self._pending = b""
        return lines


def _last_state(segment: bytes) -> bytes:
    """What a terminal would show after `segment`'s carriage returns: its last non-empty redraw."""
    for piece in reversed(segment.split(b"\r")):
        if piece.strip():
            return piece
    return b""


# --------------------------------------------------------------------------- levels

_LOGURU_LEVEL = re.compile(rb"^\s*(TRACE|DEBUG|INFO|SUCCESS|WARNING|ERROR|CRITICAL)\s*\|")
_LOUD_WORD = re.compile(rb"\b(WARNING|WARN|ERROR|CRITICAL|FATAL|Error|Exception|Warning)\b")
_TORCH_CPP = re.compile(rb"^\[[WEF]\d*[ \]]")  # c10 logging: [W socket.cpp:..] / [E1012 ...]
_QUIET_LEVEL = {b"TRACE", b"DEBUG", b"INFO", b"SUCCESS"}


QUIET, WARNING, ERROR = 0, 1, 2
_ERROR_LEVEL = {b"ERROR", b"CRITICAL"}
_ERROR_WORD = {b"ERROR", b"CRITICAL", b"FATAL", b"Error", b"Exception"}
# The step line of the log format (docs/reference/log-lines.md): every rank's is shown, never folded.
_PROGRESS = re.compile(rb"Step \[\d+/\d+\] \| Loss: ")


_ERRORISH = re.compile(rb"Traceback|ERROR|CRITICAL|FATAL|Error|Exception|^\[[EF]", re.MULTILINE)


def is_progress(line: bytes) -> bool:
    return b"Step [" in line and _PROGRESS.search(line, 0, 200) is not None


def may_be_progress(block: bytes) -> bool:
    """False: no line of `block` is a step line (one search for a whole batch)."""
    return b"Step [" in block


class Severity:
    """Tells errors, warnings and chatter apart, tracebacks included, one stream at a time."""

    def __init__(self) -> None:
        self._in_traceback = False

    def may_be_error(self, block: bytes) -> bool:
        """False: `level` would call no line of `block` an ERROR (one search for a whole batch)."""
        return self._in_traceback or _ERRORISH.search(block) is not None

    def loud(self, line: bytes) -> bool:
        return self.level(line) != QUIET

    def level(self, line: bytes) -> int:
        """QUIET, WARNING or ERROR (a traceback's every line is an ERROR); call once per line, in order."""
        if self._in_traceback:
            if line[:1] in (b" ", b"\t") or not line.strip():
                return ERROR
            self._in_traceback = line.startswith(b"During handling") or line.startswith(b"The above exception")
            return ERROR  # the exception line itself ends the block
        if line.startswith(b"Traceback (most recent call last)"):
            self._in_traceback = True
            return ERROR
        m = _LOGURU_LEVEL.match(line)
        if m:
            level = m.group(1)
            return QUIET if level in _QUIET_LEVEL else ERROR if level in _ERROR_LEVEL else WARNING
        if _TORCH_CPP.match(line):
            return WARNING if line[1:2] == b"W" else ERROR
        m = _LOUD_WORD.search(line[:160])
        if m is None:
            return QUIET
        return ERROR if m.group(1) in _ERROR_WORD else WARNING
