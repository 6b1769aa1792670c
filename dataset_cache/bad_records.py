"""What happens to a record the reader cannot use (data.on_bad_record).

`error` (the default) stops the build with one line naming the file, the line or
row, and the reason. `skip` drops the record and counts it; the count and the
first culprit go into the cache's metadata and the build summary, so a skipped
record is never silent. A compressed stream or a parquet page that cannot be
decoded loses everything after it in that unit (the rest of the file, or of the
row group); that is counted as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuherd.errors import DatasetError
from gpuherd.text import printable

SKIP_RECORD = "data.on_bad_record=skip skips such records"
SKIP_TAIL = "data.on_bad_record=skip skips the rest of such a file"


@dataclass
class BadRecords:
    policy: str = "error"  # error | skip
    records: int = 0  # records dropped (rows of a corrupt row group included)
    lost_tails: int = 0  # files whose rest could not be decoded (a corrupt or truncated stream)
    first: str = ""  # the first culprit, as the error line would have said it

    def record(self, where: str, reason: str, count: int = 1) -> None:
        """`count` unusable records at `where` (e.g. "a.jsonl line 7")."""
        self._report(where, reason, SKIP_RECORD)
        self.records += count

    def lost_tail(self, where: str, reason: str) -> None:
        """Nothing after `where` in this file can be read."""
        self._report(where, reason, SKIP_TAIL)
        self.lost_tails += 1

    def _report(self, where: str, reason: str, hint: str) -> None:
        message = f"{printable(where)}: {reason}"  # a file name may hold non-UTF-8 bytes
        if self.policy != "skip":
            raise DatasetError(f"{message}; {hint}")
        self.first = self.first or message

    @property
    def any(self) -> bool:
        return bool(self.records or self.lost_tails)

    def summary(self) -> str:
        parts = [f"{self.records:,} bad record{'s' if self.records != 1 else ''}"]
        if self.lost_tails:
            parts.append(f"the undecodable rest of {self.lost_tails} file{'s' if self.lost_tails != 1 else ''}")
        return f"skipped {' and '.join(parts)} (first: {self.first})"

    def as_dict(self) -> dict[str, Any]:
        return {"records": self.records, "lost_tails": self.lost_tails, "first": self.first}


def one_line(exc: BaseException) -> str:
    """A library's message folded into one printable line (pyarrow's span several
    lines and can quote the undecodable byte itself)."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(exc))
    return " ".join(text.split()) or type(exc).__name__
