"""A dead node's --node-rank taken back (rank_claims.py, issue 43), on a real TCPStore in this
process: node 0 frees the rank of an agent it found dead (only that agent's: a node started
again that took it already keeps it), a node started again joins node 0's restart, node 0's
direct port names the claim of the connection that closed (a newer connection for the same
rank replaces an older one, whose end is then no death), and a spare node that does not answer
node 0's ping is passed over, never promoted, and ends itself when it wakes."""

from __future__ import annotations

import queue
import threading
from datetime import timedelta

import orjson
import pytest
from torch.distributed import TCPStore

from supervisor.rendezvous import rank_claims, spare_node_agent
from supervisor.rendezvous.beat_watch import JOINED
from supervisor.rendezvous.liveness import LivenessLink, LivenessServer
from supervisor.rendezvous.store_calls import StoreCalls
from tests.supervisor.helpers import wait_for
from tests.supervisor.test_spare_node_agent import _agent  # a node agent on this process's store (3 nodes)

NODE = {"host": "h", "fingerprint": "f1", "mode": "train", "run_id": "job", "run_id_given": True, "run_dir": "/r"}
CAUSE = {"kind": "node", "exit_code": 1, "message": "node 1 (h) stopped responding: its connection closed"}


@pytest.fixture
def store(free_tcp_port):
    server = TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield StoreCalls(server)
    server.set(spare_node_agent.CLOSED_KEY, b"1")  # a spare node's thread still standing by leaves
    for thread in threading.enumerate():
        if thread.name == "spare-node":
            thread.join(timeout=5)


def test_a_rank_whose_owner_was_found_dead_is_taken_back_and_only_that_owners_claim_is_freed(store):
    dead, again, twin = b"h (agent pid 1)", b"h (agent pid 2)", b"h (agent pid 3)"
    assert rank_claims.claim(store, 1, dead) == dead
    assert rank_claims.claim(store, 1, again) == dead  # its owner lives (or is not found dead yet): refused
    rank_claims.release(store, 1, dead)  # node 0 found it dead
    assert rank_claims.claim(store, 1, again) == again  # the node started again takes it back
    rank_claims.release(store, 1, dead)  # the dead one named again (its silence after its closed connection)
    assert rank_claims.claim(store, 1, twin) == again  # frees nothing: the node started again keeps it
    assert rank_claims.transfer(store, 1, again, twin) and store.get(rank_claims.owner_key(1)) == twin


def test_a_node_started_again_joins_node_0s_open_join_or_its_next_one(store):
    assert rank_claims.round_to_join(store, 0) == 0  # node 0 has not joined: the job's first round
    store.set(rank_claims.JOINING_KEY, b"3")
    assert rank_claims.round_to_join(store, 0) == 3  # node 0 waits in round 3's join
    store.set("a3/all", JOINED)
    assert rank_claims.round_to_join(store, 0) == 4  # round 3 runs without it: node 0's restart joins 4
    store.set(rank_claims.JOINING_KEY, b"4")
    store.set("a4/all", b"abort")  # a node failed before round 4's join completed: read why there
    assert rank_claims.round_to_join(store, 0) == 4


def test_node_0_names_the_claim_of_the_connection_that_closed_and_a_replaced_one_is_no_death():
    closed: queue.SimpleQueue = queue.SimpleQueue()
    server = LivenessServer("127.0.0.1", on_closed=lambda r, claim: closed.put((r, claim)))
    frozen = LivenessLink("127.0.0.1", server.port, 1, on_closed=lambda: None, claim=b"h (agent pid 1)")
    assert wait_for(lambda: any(s[0] == 1 for s in server._state.values()), timeout=10)
    again = LivenessLink("127.0.0.1", server.port, 1, on_closed=lambda: None, claim=b"h (agent pid 2)")
    assert wait_for(lambda: sorted(s[0] is None for s in server._state.values()) == [False, True], timeout=10)
    frozen.drop()  # the frozen agent wakes and ends: node 1 is the node started again now
    again.drop()
    assert closed.get(timeout=10) == (1, b"h (agent pid 2)")
    assert closed.empty()


def test_a_frozen_spare_node_is_passed_over_and_when_it_wakes_it_ends_itself(store, free_tcp_port, monkeypatch):
    monkeypatch.setattr(spare_node_agent, "PING_S", 0.3)
    monkeypatch.setattr(spare_node_agent, "POLL_S", 0.05)
    store.set("a0/nodes", orjson.dumps([{**NODE, "node": r, "nproc": 1} for r in (0, 1, 2)]))
    store.set("a0/all", JOINED)
    node0, _ = _agent(free_tcp_port, 0)
    node0.nodes.spare_nodes = 1
    rank_claims.claim(store, 3, b"h (agent pid 9)")  # spare node 3 stood by, and froze
    store.set("a0/spare3", orjson.dumps({"host": "h", "nproc": 1, "owner": "h (agent pid 9)"}))

    assert not node0.judge._spare_node_takes(0, 1, CAUSE, node0.store)  # no answer to the ping
    assert 3 in node0.nodes.gone and not store.check(["a0/promote3"]) and not store.check(["a0/live1"])
    assert store.get("a0/pong3") == spare_node_agent.PASSED_OVER
    assert store.get(rank_claims.owner_key(3)) == b""  # a spare node started again as node 3 stands by

    woken, events = _agent(free_tcp_port, 3)  # the agent that wakes reads where it stood: the ping
    woken.handle({"cmd": "stand-by", "attempt": 0, "record": {**NODE, "nproc": 1}})
    assert wait_for(lambda: events and events[-1]["event"] == "spare-passed-over", timeout=10)
    assert events[-1]["message"].startswith("spare node 3: node 0 needed it in round 0 and it did not answer")
