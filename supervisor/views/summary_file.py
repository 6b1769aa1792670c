"""summary.json as the views read it: each field they use checked for its type; what cannot be
read is skipped and named.

The supervisor writes summary.json atomically, but `top` and `report` read whatever a run
directory holds: a file from an older or newer gpuherd, one edited by hand, or one written by
something else. `read_summary` keeps the fields the views use (`SHAPE`), each of its declared
type, and drops every other field: a view reads only what is declared here, so it never meets an
unchecked value. A field of another type is skipped and its path named (`goodput.ratio`,
`workers[2].role`); a list item that is not an object is skipped whole (`workers[2]`), and so is
a block that is only true whole (the goodput block: its parts add up to the wall time) when one
of its fields cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gpuherd.bounded_read import TooLarge, read_bounded

MAX_BYTES = 256 << 20  # a summary of thousands of ranks and attempts is a few MiB
_SKIP = object()  # what a check returns for a value it skipped


class _Value:
    """A JSON scalar of one of `types` (bool is no number: type() is checked, not isinstance)."""

    def __init__(self, *types: type, none: bool = False) -> None:
        self.types, self.none = types, none

    def clean(self, value: Any, path: str, skipped: list[str]) -> Any:
        if (value is None and self.none) or type(value) in self.types:
            return value
        skipped.append(path)
        return _SKIP


class _Each:
    """A list of `item`s (`path[i]`), or with `keyed` an object whose every value is one
    (`path.key`: goodput's badput_s, cause -> seconds)."""

    def __init__(self, item: Any, keyed: bool = False) -> None:
        self.item, self.keyed = item, keyed

    def clean(self, value: Any, path: str, skipped: list[str]) -> Any:
        if type(value) is not (dict if self.keyed else list):
            skipped.append(path)
            return _SKIP
        pairs = value.items() if self.keyed else enumerate(value)
        checked = {k: self.item.clean(v, f"{path}.{k}" if self.keyed else f"{path}[{k}]", skipped) for k, v in pairs}
        kept = {k: v for k, v in checked.items() if v is not _SKIP}
        return kept if self.keyed else list(kept.values())


class _Block:
    """An object with these fields (those absent stay absent); `whole`: skipped whole when one of
    its fields is unreadable or one of `required` is missing; `none`: null is allowed."""

    def __init__(self, fields: dict[str, Any], whole: bool = False, required: tuple[str, ...] = (),
                 none: bool = False) -> None:
        self.fields, self.whole, self.required, self.none = fields, whole, required, none

    def clean(self, value: Any, path: str, skipped: list[str]) -> Any:
        if value is None and self.none:
            return None
        if not isinstance(value, dict):
            skipped.append(path or "the whole file: not a JSON object")
            return _SKIP
        before = len(skipped)
        out = {}
        for key, shape in self.fields.items():
            if key in value:
                checked = shape.clean(value[key], f"{path}.{key}" if path else key, skipped)
                if checked is not _SKIP:
                    out[key] = checked
        missing = [key for key in self.required if key not in value]
        if missing:
            skipped.append(f"{path} (no {missing[0]})")
        if self.whole and len(skipped) > before:
            return _SKIP
        return out


INT, NUMBER, TEXT = _Value(int), _Value(int, float), _Value(str)
OPT_INT, OPT_TEXT = _Value(int, none=True), _Value(str, none=True)

GOODPUT = _Block({"ratio": NUMBER, "wall_s": NUMBER, "productive_s": NUMBER, "badput_s": _Each(NUMBER, keyed=True),
                  "shrunk_s": NUMBER}, whole=True, required=("ratio", "wall_s", "productive_s"), none=True)
SHAPE = _Block({
    "outcome": TEXT, "exit_code": INT, "duration_s": NUMBER, "started_at": TEXT, "restarts": INT,
    "max_restarts": INT,
    "root_cause": _Block({"message": TEXT, "rank": OPT_INT, "stderr_tail": _Each(TEXT)}, none=True),
    "workers": _Each(_Block({"rank": OPT_INT, "role": TEXT, "ended": TEXT})),
    "attempts": _Each(_Block({"attempt": INT, "started_at": TEXT, "duration_s": NUMBER, "outcome": OPT_TEXT},
                             whole=True, required=("attempt", "started_at", "duration_s"))),
    "suspect_devices": _Each(_Block({
        "gpu": OPT_INT, "device": TEXT, "rank": OPT_INT, "attempt": OPT_INT, "transient_faults": INT,
        "cause": TEXT, "limit": INT, "then": TEXT, "steps": _Each(INT), "evidence": _Each(TEXT)})),
    "goodput": GOODPUT,
})


@dataclass
class SummaryFile:
    values: dict[str, Any] | None = None  # None: no summary.json (yet); {}: one of which nothing can be read
    skipped: list[str] = field(default_factory=list)  # what could not be read, by path

    def skipped_line(self, most: int = 6) -> str:
        """`summary.json: 2 unreadable field(s) skipped: goodput.ratio, workers[1].role` ("" if none)."""
        if not self.skipped:
            return ""
        more = len(self.skipped) - most
        names = ", ".join(self.skipped[:most]) + (f" and {more} more" if more > 0 else "")
        return f"summary.json: {len(self.skipped)} unreadable field(s) skipped: {names}"


def read_summary(path: Path) -> SummaryFile:
    """summary.json's checked fields; an empty SummaryFile while there is none. It is written
    atomically, so one that cannot be parsed is damaged, never half-written: it is named as skipped
    whole, and so is one that is no regular file (a named pipe would block the view, a device
    would never end) or larger than MAX_BYTES."""
    try:
        value = orjson.loads(read_bounded(path, MAX_BYTES))
    except FileNotFoundError:
        return SummaryFile()
    except orjson.JSONDecodeError:
        return SummaryFile({}, ["the whole file: not JSON"])
    except TooLarge:
        return SummaryFile({}, [f"the whole file: larger than {MAX_BYTES >> 20} MiB"])
    except OSError as exc:  # NotAFile says what it is instead; else why it cannot be read
        return SummaryFile({}, [f"the whole file: {exc.strerror or exc}"])
    skipped: list[str] = []
    values = SHAPE.clean(value, "", skipped)
    return SummaryFile({} if values is _SKIP else values, skipped)
