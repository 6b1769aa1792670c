"""Watch NCCL_DEBUG=INFO lines for the transport NCCL really chose between GPUs.

NCCL logs each channel connection, e.g.
  `NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC`   (or P2P/CUMEM, P2P/direct pointer)
  `NCCL INFO Channel 00 : 0[0] -> 1[1] via SHM/direct/direct`
  `NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/0`
Ranks on one node should talk P2P (or NVLS/NVLink); SHM or NET between them
means copies through host memory or the network stack: warn once per pair.
The supervisor's log router feeds it worker lines when the user set NCCL_DEBUG=INFO
(or TRACE) for a run with several GPUs on this node; it never turns NCCL's logging on
by itself (thousands of lines per rank).
"""

from __future__ import annotations

import re

CONNECTION = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : (\d+)\[[0-9a-fx]+\] -> (\d+)\[[0-9a-fx]+\]"
                        r"(?: \[\w+\])? via (\w+)")
SLOW = {"SHM": "shared host memory", "NET": "the network stack"}


class NcclTransportWatch:
    def __init__(self, same_node_ranks: set[int]) -> None:
        self.same_node = set(same_node_ranks)
        self.transports: dict[tuple[int, int], str] = {}
        self._told: set[tuple[int, int]] = set()

    def feed(self, line: str) -> str | None:
        """A warning the first time a same-node pair uses SHM/NET, else None."""
        match = CONNECTION.search(line)
        if not match:
            return None
        src, dst, transport = int(match[1]), int(match[2]), match[3]
        pair = (min(src, dst), max(src, dst))
        self.transports[pair] = transport
        if transport in SLOW and src in self.same_node and dst in self.same_node and pair not in self._told:
            self._told.add(pair)
            return (f"NCCL connects rank {src} -> rank {dst} via {transport} ({SLOW[transport]}), not P2P: "
                    "GPU peer access is unavailable between them (see python -m supervisor.commands.topology); "
                    "expect slow collectives")
        return None
