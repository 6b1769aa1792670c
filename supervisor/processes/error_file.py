"""TORCHELASTIC_ERROR_FILE: where each rank may leave a structured error, and reading it back.

As under torchrun, every rank gets its own path in the variable; torch's `@record`
decorator (torch.distributed.elastic.multiprocessing.errors) writes it when the
decorated function raises:

    {"message": {"message": "RuntimeError: boom",
                 "extraInfo": {"py_callstack": "Traceback (most recent call last): ...", "timestamp": "..."}}}

(torch also accepts `"message": "text"`). The file sits next to the rank's log,
`worker-rank{r}-{TAG}.error.json`; when that rank is the root cause, its message and
traceback are the root cause's (summary.json and the console's root-cause block).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
MAX_MESSAGE = 500  # characters: the root cause's message is one line


@dataclass(frozen=True)
class RankError:
    message: str  # one line
    traceback: list[str]


def error_file_for(log_path: Path) -> Path:
    return log_path.with_name(log_path.name.removesuffix(".log") + ".error.json")


def read_error_file(path: Path) -> RankError | None:
    """The rank's error, or None if it wrote none (or something unreadable: the stderr tail
    still tells the story)."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    body = data.get("message") if isinstance(data, dict) else None
    if isinstance(body, dict):
        message = str(body.get("message") or "")
        extra = body.get("extraInfo") if isinstance(body.get("extraInfo"), dict) else {}
        callstack = str(extra.get("py_callstack") or "")
    elif isinstance(body, str):
        message, callstack = body, ""
    else:
        return None
    one_line = " ".join(message.split())
    if len(one_line) > MAX_MESSAGE:
        one_line = one_line[:MAX_MESSAGE - 3] + "..."
    return RankError(one_line, callstack.rstrip().splitlines()) if one_line or callstack else None
