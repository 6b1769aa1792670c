"""A live recovery's claim of a rebuilt group (regroup_agent.py's a{k}/live{g}), declared once, and
the one place a claim read back is decoded (`decode_claim`).

A node writes its claim as a JSON object: {node, rank, device, failed, kind, lost_pid,
replaced_by_pid, died_at (wall clock), action, decision}, and for a node that died whole
(node_shrink_agent.py, spare_node_agent.py) `ranks`, `spare_node`, `spare_host`. The store has
no authentication: a value without an integer `node` and `rank` is no claim (None); any other
field of the wrong type reads as not said (its default stands), as status records do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class LiveClaim:
    node: int  # the node that claimed
    rank: int  # the rank lost (a node's first rank when it died whole)
    device: str | None = None
    failed: str | None = None  # the failure, in words
    kind: str | None = None  # the failure's kind; "node": a node died whole
    lost_pid: int = 0
    replaced_by_pid: int = 0
    died_at: float | None = None  # wall clock
    action: str = "replaced"  # replaced | shrink | regrow
    decision: Mapping[str, Any] | None = None  # its word for the workers' store, as claimed
    group: tuple[int, ...] | None = None  # the ranks `decision` says train from now on (None: it names none)
    decided: Any = None  # the rank `decision` names for `action` (it should be `rank`)
    ranks: tuple[int, ...] | None = None  # a node that died whole: its ranks
    spare_node: int | None = None  # a node that died whole: the spare node that takes its place
    spare_host: str | None = None


def decode_claim(value: Any) -> LiveClaim | None:
    """The claim in `value` (a parsed JSON value); None: a value no gpuherd node writes."""
    if not (isinstance(value, dict) and _is_int(value.get("node")) and _is_int(value.get("rank"))):
        return None
    decision = value.get("decision") if isinstance(value.get("decision"), dict) else None
    action = value.get("action") if isinstance(value.get("action"), str) else "replaced"
    group = decision.get("ranks") if decision is not None else None
    return LiveClaim(node=value["node"], rank=value["rank"], device=_typed(value, "device", str),
                     failed=_typed(value, "failed", str), kind=_typed(value, "kind", str),
                     lost_pid=_typed(value, "lost_pid", int) or 0,
                     replaced_by_pid=_typed(value, "replaced_by_pid", int) or 0,
                     died_at=_typed(value, "died_at", int | float), action=action, decision=decision,
                     group=_ints(group), decided=decision.get(action) if decision is not None else None,
                     ranks=_ints(value.get("ranks")), spare_node=_typed(value, "spare_node", int),
                     spare_host=_typed(value, "spare_host", str))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _typed(value: dict[str, Any], key: str, kind: Any) -> Any:
    v = value.get(key)
    return v if isinstance(v, kind) and not isinstance(v, bool) else None


def _ints(v: Any) -> tuple[int, ...] | None:
    return tuple(v) if isinstance(v, list) and all(_is_int(x) for x in v) else None
