"""Node 0 moves a straggler node out of the job, to a spare node: what its agent checks first,
and what the node's end is then called.

Node 0's supervisor judges every node's pace (supervisor/health/node_stragglers.py); a node
slower than the move-out factor for the set time is handed to node 0's agent (`move-out`). The
move costs what a node's death costs with a spare node standing by (a live recovery, no
restart), so it is made only where that is what follows: a spare node stands by in the round
with the node's number of workers, and the node is a training node other than node 0 (node 0
hosts both stores), not found dead, not promoted into already. Then node 0 tells the node over
its direct connection (liveness.py, `out {message}`), and the node stops its workers at once
and drops that connection without `bye`: node 0 reads that end as the node's, named by the move
(`cause`), and hands its place to the spare node exactly as for a node that died whole
(node0_judge.py, spare_node_agent.py). A node that cannot be told (its connection is gone) is
not moved. The spare node's ping comes only at the takeover (it answers one ping per round): a
spare node frozen meanwhile is passed over there, and the node's end then goes on as a dead
node's would (a shrink with --min-replicas, else the job's cause and a restart).
"""

from __future__ import annotations

from typing import Any

from gpuherd.status_records import NODE_MOVED_OUT
from supervisor.rendezvous import agent_causes
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.spare_node_agent import round_records, standing_with

CLAIM_KIND = NODE_MOVED_OUT  # the spare node's claim for a node moved out (a dead node's says "node")


def why_not(store: Any, roster: Roster, r: int, members: list[int], lost: set[int]) -> str | None:
    """Why node r of round `roster.k` is not moved out now (None: it can be, a spare node stands by)."""
    if r == 0:
        return "node 0 hosts the job's stores: it cannot be replaced"
    if r not in members or r in roster.gone or r in lost:
        return f"node {r} is no longer in the round"
    if r in roster.promoted:
        return f"a spare node took node {r}'s place already in this round"
    if roster.spare_nodes <= 0:
        return "no spare node in this job (--spare-nodes)"
    nodes = round_records(store, roster.k)
    if nodes is None or r >= len(nodes):
        return "the round's join records are not readable"
    nproc = nodes[r].get("nproc")
    if next(standing_with(store, roster, nproc), None) is not None:
        return None
    return f"no spare node stands by with node {r}'s {nproc} worker(s)"


def cause(r: int, host: str, message: str) -> dict[str, Any]:
    """Node r's end once it dropped its connection as told: the move's verdict names it (a spare
    node takes its place; if none can, this is the job's cause, as a dead node's would be)."""
    return {**agent_causes.cause("node", 1, r, host, f"node {r} ({host}) was moved out as a straggler: {message}"),
            "moved_out": True}
