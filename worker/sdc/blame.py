"""Which replica is wrong, from every replica's fingerprint (rows of bucket sums, by rank).

Replicas of a data-parallel group must hold the same bits. With three or more, the ranks whose
row differs from a strict majority's are the culprits. With two (or no strict majority) the rows
alone cannot say who is wrong: the step is recomputed from the last kept state (heal.py), and a
rank whose first result differs from the recomputed one, which both ranks then agree on, is
named; a fault that comes back on the recompute leaves every disagreeing rank a suspect.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Verdict:
    agree: bool
    culprits: tuple[int, ...] = ()  # named by a strict majority; empty: undecided (or agreeing)
    healthy: tuple[int, ...] = ()

    @property
    def decided(self) -> bool:
        return self.agree or bool(self.culprits)


def judge(rows: list[tuple[int, ...]]) -> Verdict:
    """`rows[r]`: rank r's sums. Agreement, or the odd ones out by strict majority, or undecided."""
    counts = Counter(rows)
    if len(counts) == 1:
        return Verdict(True, healthy=tuple(range(len(rows))))
    row, n = counts.most_common(1)[0]
    if 2 * n <= len(rows):
        return Verdict(False)
    return Verdict(False, tuple(r for r, x in enumerate(rows) if x != row),
                   tuple(r for r, x in enumerate(rows) if x == row))


def against(first: list[tuple[int, ...]], recomputed: tuple[int, ...]) -> tuple[int, ...]:
    """The two-replica evidence: ranks whose first result differs from the agreed recomputed one."""
    return tuple(r for r, row in enumerate(first) if row != recomputed)


@dataclass(frozen=True)
class Difference:
    """Where one rank's sums leave the healthy ones: a bucket, and which bit when it is one flip."""

    bucket: str
    bit: int | None  # of the 64-bit word: the difference was exactly +-2**bit
    element_bits: int  # bits per value of the bucket's dtype (16, 32), to place `bit` in a value

    def describe(self) -> str:
        if self.bit is None:
            return f"{self.bucket}: several values differ"
        per_word = 64 // self.element_bits
        which = f"value {self.bit // self.element_bits} of its {per_word}-value word, " if per_word > 1 else ""
        return f"{self.bucket}: one bit flipped ({which}bit {self.bit % self.element_bits})"


def single_bit(delta: int) -> int | None:
    """k where delta == +-2**k modulo 2**64, else None."""
    for d in (delta & MASK, (-delta) & MASK):
        if d and d & (d - 1) == 0:
            return d.bit_length() - 1
    return None


def differences(names: list[str], bits_per_value: list[int], bad: tuple[int, ...],
                good: tuple[int, ...]) -> list[Difference]:
    return [Difference(name, single_bit(b - g), width)
            for name, width, b, g in zip(names, bits_per_value, bad, good, strict=True) if b != g]
