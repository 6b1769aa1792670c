"""A multi-node live recovery's control plane, the supervisor's side (the agent's is
regroup_agent.py): claim the rebuilt group a lost rank of this node forms, and hear of every
claim any node makes in this round.

The claim is the one agreement the nodes need: the workers find each other on the worker
store by the generation's prefix (`gpuherd-live/g`), so two nodes promoting a spare for the
same g at once would build one broken group. First writer wins; the loser falls back.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from supervisor.rendezvous.agent_messages import RegroupClaimed, Regrouped
from supervisor.rendezvous.job_link import JobLink
from supervisor.rendezvous.live_claim import decode_claim

CLAIM_S = 10.0  # the agent answers a claim in one store round trip; past this the store is taken as lost


class RegroupLink:
    def __init__(self, link: JobLink, round_: int, node_rank: int) -> None:
        self.link, self.round, self.node_rank = link, round_, node_rank
        self._answers: queue.SimpleQueue[RegroupClaimed] = queue.SimpleQueue()
        self._on_claim: Callable[[int, dict[str, Any] | None], None] | None = None
        self._calls = threading.Lock()  # stop() waits for a callback in progress
        link.listen("regroup-claim", self._answers.put)
        link.listen("regroup", self._heard)

    def claim(self, generation: int, claim: dict[str, Any]) -> str | None:
        """None: rebuilt group `generation` is this node's to form; else why not, in words."""
        self.link.command("regroup-claim", self.round, generation=generation, claim={**claim, "node": self.node_rank})
        while True:
            try:
                answer = self._answers.get(timeout=CLAIM_S)
            except queue.Empty:
                return f"the job store did not answer the claim of rebuilt group {generation} within {CLAIM_S:g} s"
            if answer.attempt == self.round and answer.generation == generation:
                break  # an answer of an earlier round, or a claim timed out before, is skipped
        if answer.won:
            return None
        other = decode_claim(answer.claim)
        node, rank = (other.node, other.rank) if other is not None else ("?", "?")
        return (f"node {node} claimed rebuilt group {generation} first (its rank {rank} was lost at the same "
                "time): two ranks lost at once on two nodes")

    def follow(self, on_claim: Callable[[int, dict[str, Any] | None], None]) -> None:
        """From now on every claim of this round (any node's, this one's too) calls back
        `on_claim(generation, claim)`, from the link's reader thread; None: an unreadable claim."""
        with self._calls:
            self._on_claim = on_claim
        self.link.command("regroup-watch", self.round)

    def stop(self) -> None:
        with self._calls:
            self._on_claim = None

    def _heard(self, event: Regrouped) -> None:
        if event.attempt != self.round:
            return
        with self._calls:
            if self._on_claim is not None:
                self._on_claim(event.generation, event.claim)
