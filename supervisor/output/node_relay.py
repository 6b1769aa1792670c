"""What a node of a multi-node job sends node 0 over the node agents' direct connections
(supervisor/rendezvous/liveness.py), and what node 0 does with every node's: console lines held
for folding across nodes (supervisor/output/cross_node.py, printed once by node 0's folding
point) and each node's pace (supervisor/health/node_stragglers.py, judged on node 0)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from supervisor.health import NodeStragglers, pace_record, read_pace
from supervisor.output.cross_node import FoldingPoint, Group

Relayed = Callable[[int, list[Any]], None]  # (node, records): what reaches this node's supervisor


class NodeRelay:
    """One per supervisor (the folding point lives across attempts); `attempt` sets it up anew."""

    def __init__(self, write: Callable[[int, bytes], None]) -> None:
        """`write(fd, data)`: the console's, where node 0 prints the merged lines."""
        self._write = write
        self.folding: FoldingPoint | None = None
        self._send: Callable[[list], None] | None = None
        self.paces: NodeStragglers | None = None  # node 0's judge of the current attempt's nodes

    def attempt(self, link: Callable[[Relayed], Callable[[list], None] | None], world_size: int,
                paces: NodeStragglers | None) -> Callable[[Group], None] | None:
        """A multi-node attempt begins: `link(receive)` is the rendezvous's `lines` (how this node
        sends, None: nowhere to fold them); `paces`: node 0's judge of every node's pace (None on
        the other nodes). Returns where this node's held console lines go."""
        if self.folding is None:
            self.folding = FoldingPoint(self._write, world_size)
        self.folding.set_world_size(world_size)
        self.paces = paces
        send = self._send = link(self._received)
        return None if send is None else (lambda group: send([group.as_record()]))

    def pace(self, compute_s: float, steps: int) -> None:
        """This node's pace at a window closed (stragglers.py), to node 0."""
        if self._send is not None:
            self._send([pace_record(compute_s, steps)])

    def _received(self, node: int, records: list[Any]) -> None:
        """Node `node`'s records, from the agent link's reader thread."""
        lines = []
        for record in records:
            pace = read_pace(record)
            if pace is None:
                lines.append(record)
            elif self.paces is not None:
                self.paces.add(node, pace[0], time.monotonic(), pace[1])
        if lines and self.folding is not None:
            self.folding.receive(node, lines)

    def close(self) -> None:
        """The job's end: every line still held across nodes is printed (before the summary)."""
        if self.folding is not None:
            self.folding.close()
