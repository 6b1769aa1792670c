"""A node lost whole with no spare node free, inside node 0's agent: with --min-replicas the job
goes on without that node's ranks (a shrink) instead of restarting every node.

Node 0, when a training node r (not 0) dies whole (its direct connection closed, or its beat
stood still) and no spare node takes its place (spare_node_agent.py is asked first), claims the
round's next rebuilt group (`a{k}/live{g}`, first claim wins, as for any live recovery) as

    {node: r, rank: its first rank still training, ranks: [its ranks still training],
     kind: "node", action: "shrink", failed, died_at, lost_pid: 0, replaced_by_pid: 0,
     decision: {"shrink": that first rank, "ranks": [every rank of the job training on]}}

The decision has the format of a one-rank shrink (worker/data_slots.py spreads any number of
lost slots over the survivors), so the workers read it unchanged: node 0's supervisor writes it
into the workers' store when it hears the claim, and every surviving node records the shrink.
The ranks training now are the round's last claim that names them (an earlier shrink or regrow),
else every rank of the job. Fewer survivors than --min-replicas: no claim, and the death is
published as the round's abort with one sentence more saying why (the restart, as before).

Node r cannot come back within the job (a fixed --nnodes: its machine is gone): node 0 stops
reading its beat, its `done`, `outcome` and `left` are not waited for (`Agent.lost_nodes`), and
the job's summary lists it as lost. The next restart's join waits for N nodes again.

The agent hands `shrink_over` a `Roster` (roster.py), never itself; the `Shrink` it returns is
applied by the agent (node_agent_main.py: `_shrink_without`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from supervisor.rendezvous.live_claim import decode_claim
from supervisor.rendezvous.nodes import node_ranks
from supervisor.rendezvous.regroup_agent import claim_next, claims
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.spare_node_agent import round_records


@dataclass(frozen=True)
class Shrink:
    """Node 0's judgement of a dead node with no spare node free: `claimed`, the job goes on without
    it (node 0 stops waiting for it); else `why_not`, said after the death's message (below the floor)."""
    claimed: bool
    why_not: str = ""


def shrink_over(store: Any, roster: Roster, r: int, failed: str) -> Shrink:
    """Node 0: node r died whole in round `roster.k` (`failed`: its cause's message) and no spare
    node took it; the shrink is claimed when the job can go on without it (the death is then a live
    recovery, not the round's abort)."""
    k = roster.k
    if roster.min_replicas <= 0 or r == 0 or roster.elastic:
        return Shrink(False)  # shrinking off; node 0 hosts both stores; an elastic job's next round admits who is there
    nodes = round_records(store, k)
    if nodes is None or r >= len(nodes):
        return Shrink(False)  # the round's records are not there (it died in the join): the restart as before
    training = _training(store, k, sum(int(n.get("nproc", 0)) for n in nodes))
    if training is None:
        return Shrink(False)  # a claim no gpuherd node writes: the supervisors fall back on it anyway
    lost = [rank for rank in node_ranks(nodes, r) if rank in training]
    survivors = [rank for rank in training if rank not in lost]
    if not lost:
        return Shrink(False)
    if len(survivors) < roster.min_replicas:
        return Shrink(False, f"; no spare node free, and the {len(survivors)} rank(s) left on the other nodes are "
                             f"fewer than --min-replicas {roster.min_replicas}: the job cannot go on without it (a "
                             "restart, if one is left)")
    claim = {"node": r, "rank": lost[0], "ranks": lost, "device": f"node {r}", "failed": failed,
             "kind": "node", "lost_pid": 0, "replaced_by_pid": 0, "died_at": time.time(), "action": "shrink",
             "decision": {"shrink": lost[0], "ranks": survivors}}
    # None: a node lost a rank in the same instant: two losses at once, the death is published
    return Shrink(claim_next(store, k, claim) is not None)


def _training(store: Any, k: int, world_size: int) -> list[int] | None:
    """The ranks training in round k now: the last claim's decision that names them (a shrink or a
    regrow: a spare's replacement keeps the group as it was), else all; None: an unreadable claim."""
    ranks = list(range(world_size))
    for raw in claims(store, k):
        claim = decode_claim(raw)
        if claim is None:
            return None
        if claim.group is not None:
            ranks = sorted(claim.group)
    return ranks
