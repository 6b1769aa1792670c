"""What the job asks of a rendezvous backend, once per attempt: where the workers meet
(`begin`), how a failure on this node reaches the others (`publisher`) and how theirs
reaches this node (`watch`), and which root cause the whole job ends with (`settle`).

Backends: `SingleNode` (single.py) and `MultiNode` (multi.py). The job hands them
its callbacks; a backend never reaches into the supervision loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from supervisor.gpus import DevicePlan
from supervisor.rendezvous.regroup_link import RegroupLink
from supervisor.rendezvous.store import HostedStore
from supervisor.summary import RootCause

OnCause = Callable[[RootCause], None]


class OnRemote(Protocol):
    """Told the job's root cause from the job store; `here`: it names this very node (node 0's agent
    found its own stall, or node 0 named this node dead): not a failure "on another node"."""

    def __call__(self, cause: RootCause, here: bool = False) -> None: ...


@dataclass
class Setup:
    """One attempt's rendezvous, as the workers see it."""

    plan: DevicePlan  # this node's slots, with global ranks
    master_addr: str
    master_port: int
    world_size: int
    resume: str | None
    store: HostedStore | None  # the worker store, if this node hosts it
    join_generation: int = 0  # a spare node that took a dead node's place: the rebuilt group its workers join
    promotion: dict | None = None  # ... and the claim that named it (the recovery every node records)


class Rendezvous(Protocol):
    node_rank: int  # --node-rank
    nnodes: int  # the nodes in the attempt running (an elastic job's change with the nodes admitted)
    group_rank: int  # this node's place among them (GROUP_RANK; --node-rank unless an elastic round skips one)
    nodes: list[dict]  # every node's place in the job (multi-node), for the summary
    helper_pid: int | None  # a helper process that lives across attempts (the node agent), if any

    def begin(self, attempt: int, plan: DevicePlan, resume: str | None) -> Setup:
        """Before spawning: this attempt's store, global ranks and resume checkpoint."""

    def publisher(self, attempt: int) -> OnCause | None:
        """What the supervision calls with this node's root cause (None: nobody to tell)."""

    def watch(self, attempt: int, on_remote: OnRemote) -> None:
        """From now on, a failure elsewhere in the job is handed to `on_remote` (any thread)."""

    def unwatch(self) -> None:
        """Stop calling `on_remote`; returns after a call in progress finished."""

    def regroup(self, attempt: int) -> RegroupLink | None:
        """Where a live recovery claims its rebuilt group and hears of the other nodes' (None:
        one node, nobody to agree with)."""

    def lines(self, receive: Callable[[int, list], None]) -> Callable[[list], None] | None:
        """A multi-node job's console lines held for folding across nodes: `receive(node, records)`
        is called (any thread) with what reaches this node (node 0: every node's); returns how this
        node sends its own (None: one node, nothing to fold with)."""

    def mover(self, attempt: int, answer: Callable[[int, str | None], None]) -> Callable[[int, str], None] | None:
        """Node 0 of a multi-node job: how a straggler node is moved out in this attempt, called
        with the node and the verdict (`answer(node, why_not)` comes back, any thread); None elsewhere."""

    def fail_before_start(self, cause: RootCause) -> RootCause:
        """This node failed before it could join; the cause the job ends with."""

    def settle(self, attempt: int, cause: RootCause | None, notes: list[str]) -> RootCause | None:
        """After the attempt: the job's root cause (the same on every node)."""

    def gather_outcomes(self, mine: dict) -> list[dict] | None:
        """At the end of the job: every node's outcome, on the node that prints the job's
        summary (node 0; a node cut off from it prints its own); None on the others."""

    def close(self) -> None:
        """End of the job: helpers stopped."""
