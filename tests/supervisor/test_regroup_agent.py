"""The job store's side of a multi-node live recovery (regroup_agent.py), on a real TCPStore in
this process: the first claim of a rebuilt group wins, a second one for it loses and is told
whose it is, and every agent following the round hears each claim once, in order."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

import orjson
from torch.distributed import TCPStore

from supervisor.rendezvous import regroup_agent
from supervisor.rendezvous.node_agent_main import Agent
from supervisor.rendezvous.store_calls import StoreCalls
from tests.supervisor.helpers import wait_for


@pytest.fixture(autouse=True)
def _quick_followers(monkeypatch):
    """Followers wait in short pieces, so each stops soon after its agent leaves, before the store."""
    monkeypatch.setattr(regroup_agent, "WAIT_S", 0.1)
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("regroup-wait-"):
            thread.join(timeout=5)


def _agents(port: int) -> tuple[TCPStore, list[tuple[Agent, list[dict]]]]:
    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False)
    out = []
    for node in (0, 1):
        connect = lambda: TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))  # noqa: E731
        agent = Agent(connect(), node_rank=node, nnodes=2, join_timeout=5.0, where=f"127.0.0.1:{port}")
        agent.connect = connect
        events: list[dict] = []
        agent.emit = lambda event, events=events, **fields: events.append({"event": event, **fields})
        out.append((agent, events))
    return server, out


def test_the_first_claim_of_a_group_wins_and_every_follower_hears_each_claim_in_order(free_tcp_port):
    server, [(agent0, events0), (agent1, events1)] = _agents(free_tcp_port)
    try:
        agent0.handle({"cmd": "regroup-watch", "attempt": 3})
        agent1.handle({"cmd": "regroup-claim", "attempt": 3, "generation": 1,
                       "claim": {"node": 1, "rank": 5, "replaced_by_pid": 900}})
        agent0.handle({"cmd": "regroup-claim", "attempt": 3, "generation": 1, "claim": {"node": 0, "rank": 2}})
        assert events1 == [{"event": "regroup-claim", "attempt": 3, "generation": 1, "won": True,
                            "claim": {"node": 1, "rank": 5, "replaced_by_pid": 900}}]
        assert events0[-1]["event"] == "regroup-claim" and not events0[-1]["won"]
        assert events0[-1]["claim"]["node"] == 1  # told whose it is
        StoreCalls(server).set("a3/live2", b"\x00not a claim")  # no gpuherd node writes that
        assert wait_for(lambda: len([e for e in events0 if e["event"] == "regroup"]) == 2, timeout=10)
        heard = [e for e in events0 if e["event"] == "regroup"]
        assert [(e["generation"], e["claim"] and e["claim"]["rank"]) for e in heard] == [(1, 5), (2, None)]
    finally:
        agent0.leaving = agent1.leaving = True  # the follower stops at its next wait


def test_claims_of_another_round_are_not_heard(free_tcp_port):
    server, [(agent0, events0), _] = _agents(free_tcp_port)
    try:
        agent0.handle({"cmd": "regroup-watch", "attempt": 1})
        StoreCalls(server).set("a0/live1", orjson.dumps({"node": 1, "rank": 1}))
        StoreCalls(server).set("a1/live1", orjson.dumps({"node": 1, "rank": 3}))
        assert wait_for(lambda: events0, timeout=10)
        time.sleep(0.2)
        assert [(e["attempt"], e["claim"]["rank"]) for e in events0] == [(1, 3)]
    finally:
        agent0.leaving = True


def test_a_node_shrink_heard_marks_that_node_gone_and_a_ranks_claim_marks_none(free_tcp_port):
    """regroup_agent.follow only yields the claims; the agent applies them: a node node 0 found
    dead whole and shrank the job without is gone (no `alive` check waits for it), a lost rank's
    node is not."""
    server, [(agent0, events0), _] = _agents(free_tcp_port)
    try:
        agent0.handle({"cmd": "regroup-watch", "attempt": 0})
        StoreCalls(server).set("a0/live1", orjson.dumps({"node": 1, "rank": 1, "kind": "rank"}))
        StoreCalls(server).set("a0/live2", orjson.dumps({"node": 1, "rank": 1, "kind": "node", "action": "shrink"}))
        assert wait_for(lambda: len(events0) == 2, timeout=10)
        assert [e["generation"] for e in events0] == [1, 2] and agent0.nodes.gone == {1}
        assert regroup_agent.lost_whole(events0[0]["claim"]) == [] and regroup_agent.lost_whole(None) == []
    finally:
        agent0.leaving = True
