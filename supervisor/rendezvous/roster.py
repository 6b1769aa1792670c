"""What node 0's agent hands its friend modules (spare_node_agent.py, node_shrink_agent.py) when a
node dies whole: a frozen copy of what it knows of the round, never the agent itself. They read
the store and this; what they decide comes back as a value (a spare node handed the place, a
shrink claimed, spare nodes found frozen) that the agent applies to its own state (node_agent_main.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Roster:
    k: int  # the round (attempt) the node died in
    nnodes: int  # training nodes (--nnodes; MAX of an elastic job): spare node s is nnodes <= s
    spare_nodes: int = 0  # --spare-nodes (node 0's own join record)
    min_replicas: int = 0  # --min-replicas (node 0's own join record): a dead node may shrink the job
    elastic: bool = False  # --nnodes MIN:MAX: the next round admits who is there, no shrink
    gone: frozenset[int] = frozenset()  # nodes (training or spare) found dead
    promoted: Mapping[int, int] = field(default_factory=dict)  # round k: dead node -> the spare node in its place
    owners: Mapping[int, bytes] = field(default_factory=dict)  # each node's agent in the round (rank_claims.owner_mark)

    def spares_free(self) -> list[int]:
        """The spare nodes, lowest first, neither found dead nor promoted in this round."""
        taken = set(self.promoted.values())
        return [s for s in range(self.nnodes, self.nnodes + self.spare_nodes) if s not in self.gone and s not in taken]
