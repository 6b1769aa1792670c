"""Who holds each --node-rank of the job, and a dead node's rank taken back by the node started
again in its place (a host reboot, an OOM-killed supervisor, a scheduler restarting a pod).

    rank{r}/owner   the node agent holding --node-rank r: "host (agent pid N)" (`owner_mark`), set
                    by the first agent to claim it; "" once node 0 found that agent dead (its
                    connection to node 0 closed without a goodbye, or its beat stood still): the
                    next agent started with --node-rank r takes it, at once
    joining         node 0's latest join of a fixed-size job: the round a node arriving now joins
                    (or the next one, when that round's join is decided already)

A second node started with a rank whose owner is alive (or not yet found dead) is refused
alone, exit 2, before its record could overwrite the owner's. A spare node taking a dead
node's place gets that node's rank from node 0 (`transfer`, dead owner -> spare node, in one
compare-and-set), and its own spare rank is freed for a spare node started again.
"""

from __future__ import annotations

import os
from typing import Any

from supervisor.rendezvous.beat_watch import JOINED, all_key

JOINING_KEY = "joining"


def owner_key(r: int) -> str:
    return f"rank{r}/owner"


def owner_mark(record: dict[str, Any]) -> bytes:
    """What `rank{r}/owner` holds for the agent that owns --node-rank r (this process)."""
    return f"{record.get('host', '?')} (agent pid {os.getpid()})".encode()


def claim(store: Any, r: int, mine: bytes) -> bytes:
    """Take --node-rank r when nobody holds it (never claimed, or its owner found dead); returns
    the owner after the call: `mine`, or the agent that holds it."""
    return store.compare_set(owner_key(r), "", mine)


def release(store: Any, r: int, dead: bytes | None) -> None:
    """Node 0: the agent `dead` was found dead; --node-rank r is free unless someone else holds it
    by now (a spare node given its place, a node started again that took it already)."""
    if dead:
        store.compare_set(owner_key(r), dead, b"")


def transfer(store: Any, r: int, dead: bytes | None, spare: bytes) -> bool:
    """Node 0: --node-rank r passes from its dead owner to the spare node taking its place; False
    when another agent holds it (it was released and taken already)."""
    return store.compare_set(owner_key(r), dead or "", spare) == spare


def round_to_join(store: Any, k: int) -> int:
    """A node other than 0 joining a fixed-size job for the first time: node 0's latest join,
    unless that round runs (or ran) without this node, then the next one (node 0 joins it at its
    restart); `k` when node 0 has not joined yet (the job's first round). A round whose join
    was aborted is joined all the same: this node reads its cause there, as the others did."""
    raw = store.get_if_set(JOINING_KEY)
    if raw is None or not raw.isdigit():
        return k
    joining = int(raw)
    return max(k, joining + 1 if store.get_if_set(all_key(joining)) == JOINED else joining)
