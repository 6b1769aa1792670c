"""A straggler node moved out to a spare node, on the agents' side (node_move_out.py, node0_judge.py,
liveness.py), on a real TCPStore and real direct connections in this process: node 0's agent
tells the node only where a spare node stands by with its number of workers; the node told
stops beating, tells its supervisor and drops its connection; node 0 hands its place to the
spare node, the claim naming the move; the moved node's later `done`, `outcome` and `left`
are the spare node's, never written by it."""

from __future__ import annotations

from datetime import timedelta

import orjson
import pytest
from torch.distributed import TCPStore

from supervisor.rendezvous import node_move_out
from supervisor.rendezvous.beat_watch import JOINED
from supervisor.rendezvous.elastic_rounds import CLOSED_KEY
from supervisor.rendezvous.node_agent_main import Agent
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.store_calls import StoreCalls
from tests.supervisor.agent_helpers import in_process_agent, quick_spares  # noqa: F401 (a fixture)
from tests.supervisor.helpers import wait_for

NODE = {"host": "h", "fingerprint": "f1", "mode": "train", "run_id": "job", "run_id_given": True, "run_dir": "/r"}
VERDICT = "node 1 computed 4.00x the median of the other nodes for 30 s"


@pytest.fixture(autouse=True)
def _quick_spares(quick_spares):
    yield


@pytest.fixture
def server(free_tcp_port):
    store = TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    records = [{**NODE, "node": r, "nproc": 1, "host": f"h{r}"} for r in range(2)]
    StoreCalls(store).set("a0/nodes", orjson.dumps(records))
    StoreCalls(store).set("a0/all", JOINED)
    yield store
    StoreCalls(store).set(CLOSED_KEY, b"1")  # the job's end: a spare node standing by leaves


def _agent(port: int, node: int) -> tuple[Agent, list[dict]]:
    return in_process_agent(port, node, nnodes=2)


def _job(port: int, spare_nproc: int | None) -> tuple[tuple[Agent, list], tuple[Agent, list], tuple[Agent, list] | None]:
    """Round 0 running on nodes 0 and 1 (one worker each), with a spare node 2 standing by with
    `spare_nproc` workers (None: no spare node)."""
    node0, events0 = _agent(port, 0)
    node0.serve_liveness("127.0.0.1")
    node0.nodes.spare_nodes = 0 if spare_nproc is None else 1
    node0.nodes.joined([0, 1], [{**NODE, "nproc": 1, "host": f"h{r}", "owner": f"o{r}"} for r in range(2)])
    node0.judge.watch(0)
    node1, events1 = _agent(port, 1)
    node1.mark = b"o1"
    StoreCalls(node0.store).set("rank1/owner", b"o1")  # its claim on --node-rank 1 (rank_claims.py)
    node1.beat.start(0)
    node1._link_to_node0(node0.liveness_at)
    spare = None
    if spare_nproc is not None:
        spare = _agent(port, 2)
        spare[0].handle({"cmd": "stand-by", "attempt": 0, "record": {**NODE, "nproc": spare_nproc}})
        assert wait_for(lambda: spare[1] and spare[1][-1]["event"] == "standing-by", timeout=10)
    assert wait_for(lambda: node0.liveness_server.speaks_for(1), timeout=10)  # node 1's `hello` came
    return (node0, events0), (node1, events1), spare


def test_node_0_moves_a_straggler_node_out_and_a_spare_node_takes_its_place_named_by_the_move(server, free_tcp_port):
    (node0, events0), (node1, events1), spare = _job(free_tcp_port, spare_nproc=1)
    node0.handle({"cmd": "move-out", "attempt": 0, "node": 1, "message": VERDICT})
    assert events0[-1] == {"event": "move-out", "attempt": 0, "node": 1, "why_not": None}
    assert wait_for(lambda: any(e["event"] == "moved-out" for e in events1), timeout=10)
    (told,) = [e for e in events1 if e["event"] == "moved-out"]
    assert told == {"event": "moved-out", "attempt": 0, "message": VERDICT}
    assert node1.beat.attempt is None and node1.moved_out  # it beats no more: the spare node beats as node 1
    agent2, events2 = spare
    assert wait_for(lambda: events2[-1]["event"] == "promoted", timeout=10)
    claim = orjson.loads(StoreCalls(server).get("a0/live1"))
    assert claim["node"] == 1 and claim["spare_node"] == 2
    assert claim["failed"] == f"node 1 (h1) was moved out as a straggler: {VERDICT}"
    assert agent2.node_rank == 1
    assert not any(e["event"] == "lost" for e in events1)  # it dropped the connection itself: no "node 0 gone"
    for cmd in ({"cmd": "done", "attempt": 0}, {"cmd": "outcome", "outcome": {"node": 1}}, {"cmd": "leave"}):
        node1.handle(cmd)
    assert not StoreCalls(server).check(["a0/done1"]) and not StoreCalls(server).check(["outcome1"])
    assert not StoreCalls(server).check(["left1"])  # the spare node's `left` as node 1 is the one node 0 waits for


@pytest.mark.parametrize(("spare_nproc", "node", "why"), [
    (None, 1, "no spare node in this job (--spare-nodes)"),
    (2, 1, "no spare node stands by with node 1's 1 worker(s)"),
    (1, 0, "node 0 hosts the job's stores: it cannot be replaced"),
    (1, 5, "node 5 is no longer in the round"),
])
def test_a_node_is_not_told_to_leave_where_no_spare_node_can_take_its_place(server, free_tcp_port, spare_nproc, node,
                                                                            why):
    (node0, events0), (_node1, events1), _spare = _job(free_tcp_port, spare_nproc)
    node0.handle({"cmd": "move-out", "attempt": 0, "node": node, "message": VERDICT})
    assert events0[-1] == {"event": "move-out", "attempt": 0, "node": node, "why_not": why}
    assert node0.judge.moving_out == {}
    assert not wait_for(lambda: events1, timeout=0.5)  # node 1 heard nothing


def test_a_node_already_in_a_spare_nodes_hands_or_in_another_round_is_not_moved(server):
    store = StoreCalls(server)
    roster = Roster(0, 2, spare_nodes=1, promoted={1: 2})
    assert node_move_out.why_not(store, roster, 1, [0, 1], set()) == "a spare node took node 1's place already in this round"
    assert node_move_out.why_not(store, Roster(0, 2, spare_nodes=1), 1, [0, 1], {1}) == "node 1 is no longer in the round"
