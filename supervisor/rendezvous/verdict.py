"""Node 0's verdict (`a{k}/verdict`): what an `alive` check on any node needs of node 0's
reading of the beats, in bytes that do not grow with the nodes.

    {"seq": s, "floor": f, "late": {"r": seq r last moved in, ...}, "dead": [cause, ...]}

`seq`: node 0's reads of attempt k's beats so far. `late`: each member (node 0 aside, the dead
aside) whose beat stood still for 1.5 s (two beats) at read s, or that node 0 has not read yet
(0), with the read its beat last moved in: a healthy node beats once a second (four times a
second while it has an `alive` check pending, when node 0 may read four times as often too),
so none stands still that long but one that stalls or vanished. `floor`: the earliest read any
other member not in `late` last moved in. So a node not in `late` moved in read `floor` or
later, one in `late` in its read exactly: enough for the check's one question (did every node
move after the check began?) without a seq per node. The old form, a seq for every
node, was 43 MB read by 1,024 survivors for one worker failure (about 22 GB at 16,384).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

import orjson


def summary(seq: int, moved: dict[int, int], dead: dict[int, dict[str, Any]], members: Iterable[int],
            stood: Container[int] | None = None) -> dict[str, Any]:
    """The verdict after read `seq`; `moved`: node -> the read its beat last moved in (nodes
    node 0 reads); `members`: the round's nodes (one never read counts as moved in read 0).
    `stood`: the nodes node 0 read whose beat stood still too long (beat_watch.py: by the clock,
    so that node 0 reading faster during an `alive` check does not list every node); None: those
    that stood still in the last two reads. Any choice is safe: a node not listed is taken to have
    moved in read `floor`, the earliest of them."""
    late: dict[str, int] = {}
    floor = seq
    for r in members:
        if r == 0 or r in dead:
            continue
        at = moved.get(r, 0)
        if (r in stood) if (stood is not None and r in moved) else at < seq - 1:
            late[str(r)] = at
        else:
            floor = min(floor, at)
    return {"seq": seq, "floor": floor, "late": late, "dead": list(dead.values())}


def parse_verdict(raw: bytes | None) -> dict[str, Any] | None:
    """A verdict as node 0 writes it, or None for a value it never writes (a foreign writer)."""
    if raw is None:
        return {"seq": 0, "floor": 0, "late": {}, "dead": []}  # node 0 has read no beat yet
    try:
        v = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    ok = (isinstance(v, dict) and _count(v.get("seq")) and _count(v.get("floor"))
          and isinstance(v.get("late"), dict) and all(_count(s) for s in v["late"].values())
          and isinstance(v.get("dead"), list)
          and all(isinstance(c, dict) and isinstance(c.get("node"), int) and isinstance(c.get("message"), str)
                  for c in v["dead"]))
    return v if ok else None


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def undecided(verdict: dict[str, Any], seq0: int, ranks: list[int]) -> list[int]:
    """The nodes not yet proven alive since an `alive` check began (when node 0's verdict was
    `seq0`): a node is alive once its beat moved in a read node 0 made after the check began
    (seq0 + 2: read seq0 + 1 may have come just before), dead once named. A node not in `late`
    moved in read `floor` or later: proven when the floor is seq0 + 2, never counted alive
    on a guess (at worst one read later than a seq of its own would have said)."""
    dead = {c["node"] for c in verdict["dead"]}
    late, floor = verdict["late"], verdict["floor"]
    return [r for r in ranks if r not in dead and late.get(str(r), floor) < seq0 + 2]
