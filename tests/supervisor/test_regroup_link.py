"""The supervisor's side of a multi-node live recovery's control plane (regroup_link.py), over a
fake agent link: a claim's answer is matched to its round and generation, a lost claim names
the node that made it, and only this round's claims are passed on."""

from __future__ import annotations

from typing import Any

from supervisor.rendezvous import regroup_link
from supervisor.rendezvous.agent_messages import decode_event
from supervisor.rendezvous.regroup_link import RegroupLink


class FakeLink:
    """The agent: answers each command with the events a test queued for it."""

    def __init__(self) -> None:
        self.listeners: dict[str, Any] = {}
        self.sent: list[tuple[str, int, dict]] = []
        self.answers: list[tuple[str, dict]] = []

    def listen(self, kind: str, callback) -> None:
        self.listeners[kind] = callback

    def command(self, cmd: str, attempt: int, **fields: Any) -> None:
        self.sent.append((cmd, attempt, fields))
        for kind, event in self.answers:
            self.hear(kind, event)
        self.answers.clear()

    def hear(self, kind: str, event: dict) -> None:
        """The agent's event as the job link's reader hands it on: decoded."""
        self.listeners[kind](decode_event({"event": kind, **event}))


def test_a_won_claim_carries_this_nodes_rank_and_skips_answers_of_other_claims():
    link = FakeLink()
    regroup = RegroupLink(link, round_=2, node_rank=1)
    link.answers = [("regroup-claim", {"attempt": 1, "generation": 1, "won": False}),  # an earlier round's
                    ("regroup-claim", {"attempt": 2, "generation": 1, "won": True, "claim": {"node": 1}})]
    assert regroup.claim(1, {"rank": 3}) is None
    assert link.sent == [("regroup-claim", 2, {"generation": 1, "claim": {"rank": 3, "node": 1}})]


def test_a_lost_claim_names_the_node_that_claimed_first_and_no_answer_is_said_too(monkeypatch):
    link = FakeLink()
    regroup = RegroupLink(link, round_=0, node_rank=1)
    link.answers = [("regroup-claim", {"attempt": 0, "generation": 1, "won": False,
                                       "claim": {"node": 2, "rank": 5}})]
    assert regroup.claim(1, {"rank": 3}) == ("node 2 claimed rebuilt group 1 first (its rank 5 was lost at the same "
                                             "time): two ranks lost at once on two nodes")
    monkeypatch.setattr(regroup_link, "CLAIM_S", 0.05)
    assert regroup.claim(2, {"rank": 3}) == "the job store did not answer the claim of rebuilt group 2 within 0.05 s"


def test_only_this_rounds_claims_are_passed_on_until_stopped():
    link = FakeLink()
    regroup = RegroupLink(link, round_=4, node_rank=0)
    heard: list[tuple[int, dict | None]] = []
    regroup.follow(lambda g, claim: heard.append((g, claim)))
    assert link.sent == [("regroup-watch", 4, {})]
    link.hear("regroup", {"attempt": 3, "generation": 1, "claim": {"node": 1, "rank": 1}})
    link.hear("regroup", {"attempt": 4, "generation": 1, "claim": {"node": 1, "rank": 1}})
    link.hear("regroup", {"attempt": 4, "generation": 2, "claim": None})
    regroup.stop()
    link.hear("regroup", {"attempt": 4, "generation": 3, "claim": {"node": 2, "rank": 2}})
    assert heard == [(1, {"node": 1, "rank": 1}), (2, None)]
