"""Field limits declared on the config fields themselves.

`limited(default, gt=0)` is a dataclass field whose metadata carries a `Limits`;
`validate()` walks the fields and checks each against its own limits, so a
renamed field takes its rule (and the name in the message) with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpuherd.errors import ConfigError
from gpuherd.text import did_you_mean

LIMITS = "limits"  # the metadata key


@dataclass(frozen=True)
class Limits:
    """What a field's value may be; None (an unset optional field) is always allowed."""

    choices: tuple[str, ...] = ()
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    ids: bool = False  # a list of distinct non-negative ids (GPU ids, ranks)

    def check(self, dotted: str, value: Any) -> None:
        """Raise ConfigError naming `dotted` when `value` breaks a limit."""
        if value is None:
            return
        if self.choices and value not in self.choices:
            raise ConfigError(f"{dotted} must be one of {', '.join(self.choices)}; "
                              f"got '{value}'{did_you_mean(str(value), self.choices)}")
        if self.ids:
            if any(i < 0 for i in value):
                raise ConfigError(f"{dotted} must hold non-negative ids, got {value}")
            if len(set(value)) != len(value):
                raise ConfigError(f"{dotted} lists an id twice: {value}")
        if not self._in_range(value):
            raise ConfigError(f"{dotted} must be {self._range_text()}, got {value}")

    def _in_range(self, value: Any) -> bool:
        return ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le))

    def _range_text(self) -> str:
        low = ("(", self.gt) if self.gt is not None else ("[", self.ge)
        high = (")", self.lt) if self.lt is not None else ("]", self.le)
        if high[1] is None:
            return f"> {low[1]}" if low[0] == "(" else f">= {low[1]}"
        if low[1] is None:
            return f"< {high[1]}" if high[0] == ")" else f"<= {high[1]}"
        return f"within {low[0]}{low[1]}, {high[1]}{high[0]}"


def limited(default: Any, **limits: Any) -> Any:
    """A dataclass field with `default` and the given `Limits` (choices, gt, ge, lt, le, ids)."""
    return dataclasses.field(default=default, metadata={LIMITS: Limits(**limits)})


def field_limits(field: dataclasses.Field) -> Limits | None:
    return field.metadata.get(LIMITS)
