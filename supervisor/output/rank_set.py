"""A set of ranks in the compact form every gpuherd surface uses: `GPU[0-3,5]` for devices on
one node, `n[0-255]/r[0-2047]` for ranks across nodes, `0-3,5` for a bare set.

One spelling everywhere (the folded console lines, `top`'s summary rows, the report), so a
reader who learned it once can grep for it."""

from __future__ import annotations

from collections.abc import Iterable


def ranges(numbers: Iterable[int]) -> str:
    """`0-3,5,7-9`: sorted, runs of consecutive numbers joined by a dash, each number once."""
    out: list[str] = []
    start = prev = None
    for n in sorted(set(numbers)):
        if prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = n
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out)


def devices(kind: str, ids: Iterable[int]) -> str:
    """`GPU[0-3,5]`: devices of one kind on one node."""
    return f"{kind}[{ranges(ids)}]"


def node_ranks(nodes: Iterable[int], ranks: Iterable[int]) -> str:
    """`n[0-255]/r[0-2047]`: global ranks on several nodes."""
    return f"n[{ranges(nodes)}]/r[{ranges(ranks)}]"
