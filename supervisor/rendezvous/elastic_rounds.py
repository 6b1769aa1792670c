"""Elastic rounds (`--nnodes MIN:MAX`) on the job store: who is admitted to each attempt.

The semantics of torch's c10d rendezvous (torch/distributed/elastic/rendezvous/
dynamic_rendezvous.py), with gpuherd's node ranks kept (every node still says its
`--node-rank`, 0..MAX-1; node 0 hosts the store, so it is always in):

- node 0 opens round k (`round` = k) and waits up to the join timeout until MIN nodes
  have written their join records; fewer by then ends the job (exit 5) naming who came;
- once MIN are in, a last call (`system.rendezvous_last_call`, torchrun's
  last_call_timeout) waits for more, up to MAX, then node 0 closes the round by writing
  its members (`a{k}/members`, a JSON list of node ranks);
- a node that finds round k closed without it is late: it writes its record for round
  k+1 and waits there ("waiting to join"), which node 0's agent sees while round k runs
  (torchrun's num_nodes_waiting) and answers by restarting every node's workers, a
  restart that does not count against --max-restarts, as under torchrun;
- `closed` (node 0, when the job ends) releases a node still waiting: it was never admitted.

A round's ranks are laid out in node-rank order over its members, so world size and
rank offsets follow the nodes actually admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from supervisor.rendezvous.beat_watch import enter
from supervisor.rendezvous.store_calls import StoreCalls

POLL_S = 0.1  # node 0 counts the records that came this often while a round is open (a few requests each)
WAIT_S = 1.0  # a node waiting for a round asks the server to wake it, and looks for an abort this often
ROUND_KEY = "round"  # the round node 0 opened last
CLOSED_KEY = "closed"  # the job ended: no round opens any more


def members_key(k: int) -> str:
    return f"a{k}/members"


def refused_key(r: int) -> str:
    return f"refused{r}"


class ElasticRounds:
    """One node's view of the rounds; `store` is torch's TCPStore (check/get/set/compare_set)."""

    def __init__(self, store: Any, node_rank: int, min_nodes: int, max_nodes: int, join_timeout: float,
                 last_call: float) -> None:
        self.store, self.node_rank = StoreCalls(store), node_rank
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.join_timeout, self.last_call = join_timeout, last_call
        self.round: int | None = None  # the last round this node was a member of
        self.members: list[int] = []

    def _present(self, k: int) -> list[int]:
        absent = set(self.store.missing([f"a{k}/node{r}" for r in range(self.max_nodes)]))
        return [r for r in range(self.max_nodes) if r not in absent]

    def members_of(self, k: int) -> list[int] | None:
        key = members_key(k)
        if not self.store.check([key]):
            return None
        try:
            value = orjson.loads(self.store.get(key))
        except orjson.JSONDecodeError:
            return []  # not node 0's: nobody is admitted by it
        return value if isinstance(value, list) and all(isinstance(r, int) for r in value) else []

    # ---------------------------------------------------------------- node 0
    def open_and_close(self, record: bytes, aborted: Callable[[int], bool]) -> tuple[int, list[int] | None]:
        """Node 0: open the next round, wait for MIN then the last call, close it.
        Returns (round, members), or (round, None) when an abort came or fewer than MIN joined."""
        k = 0 if self.round is None else self.round + 1
        enter(self.store, k, self.node_rank, record)
        self.store.set(ROUND_KEY, str(k).encode())
        deadline = time.monotonic() + self.join_timeout
        while len(self._present(k)) < self.min_nodes:
            if aborted(k) or time.monotonic() >= deadline:
                return k, None
            time.sleep(POLL_S)
        last_call = time.monotonic() + self.last_call
        while len(self._present(k)) < self.max_nodes and time.monotonic() < last_call:
            if aborted(k):
                return k, None
            time.sleep(POLL_S)
        members = self._present(k)
        self.store.set(members_key(k), orjson.dumps(members))
        self.round, self.members = k, members
        return k, members

    def too_few(self, k: int, hosts: Callable[[int], str], where: str) -> dict[str, Any]:
        """The job's root cause when round k did not reach MIN nodes in time (exit 5)."""
        came = self._present(k)
        missing = [r for r in range(self.max_nodes) if r not in came]
        return {"kind": "rendezvous", "exit_code": 5, "node": None, "host": None, "rank": None, "device": None,
                "stderr_tail": [],
                "message": f"only {len(came)} of the {self.min_nodes}..{self.max_nodes} nodes (--nnodes "
                           f"{self.min_nodes}:{self.max_nodes}) joined within {self.join_timeout:g} s "
                           f"(system.rendezvous_timeout) at {where}: came: "
                           + ", ".join(f"node {r} ({hosts(r)})" for r in came)
                           + "; not: " + ", ".join(f"node {r}" for r in missing)}

    def waiting(self, k: int) -> list[int]:
        """Node 0, while round k runs: the nodes not in it that already wait for round k+1."""
        return [r for r in range(self.max_nodes)
                if r not in self.members and self.store.check([f"a{k + 1}/node{r}"])]

    def refuse(self, k: int, r: int, cause: bytes) -> None:
        """Node 0: node r, waiting for round k+1, cannot run in this job (other settings): it is
        told why (`refused_key`) and its record withdrawn, so no round ever admits it."""
        self.store.set(refused_key(r), cause)
        self.store.delete_key(f"a{k + 1}/node{r}")

    def close_job(self) -> None:
        self.store.set(CLOSED_KEY, b"1")

    # ---------------------------------------------------------------- other nodes
    def target(self) -> tuple[int, bool] | None:
        """The round this node joins next, and whether it is late (a round runs without it).
        None while node 0 has opened no round yet."""
        if self.round is not None:
            return self.round + 1, False
        if not self.store.check([ROUND_KEY]):
            return None
        k = int(self.store.get(ROUND_KEY))
        members = self.members_of(k)
        if members is not None and self.node_rank not in members:
            return k + 1, True
        return k, False

    def admitted(self, k: int, record: bytes, aborted: Callable[[int], bool],
                 on_late: Callable[[int, list[int]], None]) -> tuple[int, list[int] | None, str]:
        """A node other than 0 joins round k: (round, members, "") once admitted, else
        (round, None, why): "aborted", "closed". `on_late(running_round, its members)` is
        called once when the node has to wait for the next round."""
        while True:
            enter(self.store, k, self.node_rank, record)
            members = self._wait_members(k, aborted)
            if members is None:
                if self.store.check([refused_key(self.node_rank)]):
                    return k, None, "refused"
                return k, None, "closed" if self.store.check([CLOSED_KEY]) else "aborted"
            if self.node_rank in members:
                self.round, self.members = k, members
                return k, members, ""
            on_late(k, members)  # the round closed just before this node's record came
            k += 1

    def wait_round(self, timeout: float) -> tuple[int, bool] | None:
        """The round to join once node 0 opened one (None: not within `timeout`)."""
        deadline = time.monotonic() + timeout
        while (target := self.target()) is None:
            if self.store.check(["a0/abort"]):  # node 0 failed before it could open a round (its dataset)
                return 0, False
            if time.monotonic() >= deadline:
                return None
            self.store.wait([ROUND_KEY], min(WAIT_S, max(0.0, deadline - time.monotonic())))
        return target

    def _wait_members(self, k: int, aborted: Callable[[int], bool]) -> list[int] | None:
        while True:
            members = self.members_of(k)
            if members is not None:
                return members
            if aborted(k) or self.store.check([CLOSED_KEY]) or self.store.check([refused_key(self.node_rank)]):
                return None
            self.store.wait([members_key(k)], WAIT_S)

