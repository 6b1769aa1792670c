"""Spare nodes on the job store (spare_node_agent.py), on a real TCPStore in this process: a spare
node stands by in the round, node 0 hands the place of a dead node to one standing by with that
node's number of workers (not a dead one, not one already promoted), in the round's next
rebuilt group, and the spare node becomes that node; a spare node with other settings is
refused alone, one reading a foreign value names it; the job's end releases a spare node
standing by."""

from __future__ import annotations

from datetime import timedelta

import orjson
import pytest
from torch.distributed import TCPStore

from supervisor.rendezvous import spare_node_agent
from supervisor.rendezvous.beat_watch import JOINED
from supervisor.rendezvous.node_agent_main import Agent
from supervisor.rendezvous.store_calls import StoreCalls
from tests.supervisor.agent_helpers import in_process_agent, quick_spares  # noqa: F401 (a fixture)
from tests.supervisor.helpers import wait_for

NODE = {"host": "h", "fingerprint": "f1", "mode": "train", "run_id": "job", "run_id_given": True, "run_dir": "/r"}
CAUSE = {"kind": "node", "exit_code": 1, "message": "node 2 (h2) stopped responding: its connection closed"}


@pytest.fixture(autouse=True)
def _quick_spares(quick_spares):
    yield


def _agent(port: int, node: int) -> tuple[Agent, list[dict]]:
    return in_process_agent(port, node, nnodes=3)


def _round(server: TCPStore, nprocs: list[int]) -> None:
    """Round 0 joined by the training nodes (node r runs nprocs[r] workers)."""
    store = StoreCalls(server)
    store.set("a0/nodes", orjson.dumps([{**NODE, "node": r, "nproc": n} for r, n in enumerate(nprocs)]))
    store.set("a0/all", JOINED)


def _stand_by(agent: Agent, nproc: int, **record) -> None:
    agent.handle({"cmd": "stand-by", "attempt": 0, "record": {**NODE, "nproc": nproc, **record}})


def test_node_0_hands_a_dead_node_to_a_live_spare_node_with_its_workers(free_tcp_port):
    server = TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    try:
        _round(server, [1, 2, 1])
        StoreCalls(server).set("a0/live1", orjson.dumps({"node": 1, "rank": 1}))  # a rank recovered earlier
        node0, _ = _agent(free_tcp_port, 0)
        node0.nodes.spare_nodes = 3
        spares = {s: _agent(free_tcp_port, s) for s in (3, 4, 5)}
        _stand_by(spares[3][0], 2)  # not node 2's number of workers
        _stand_by(spares[4][0], 1)  # it died standing by (its connection closed)
        _stand_by(spares[5][0], 1)
        assert wait_for(lambda: all(e and e[-1]["event"] == "standing-by" for _, e in spares.values()), timeout=10)
        node0.nodes.gone.add(4)

        assert node0.judge._spare_node_takes(0, 2, CAUSE, node0.store)
        claim = orjson.loads(StoreCalls(server).get("a0/live2"))  # the round's next rebuilt group
        assert (claim["node"], claim["rank"], claim["ranks"], claim["spare_node"]) == (2, 3, [3], 5)
        agent5, events5 = spares[5]
        assert wait_for(lambda: events5[-1]["event"] == "promoted", timeout=10)
        assert (events5[-1]["generation"], events5[-1]["node"], events5[-1]["claim"]) == (2, 2, claim)
        assert agent5.node_rank == 2 and agent5.beat.attempt == 0 and agent5.beat.node_rank == 2  # it beats, finishes and leaves as node 2
        assert agent5._claim_rank(1, {**NODE, "nproc": 1})  # a restart's join as node 2 is its own
        assert StoreCalls(server).get("rank2/owner") == agent5.mark  # node 0 handed node 2's rank over
        assert StoreCalls(server).get("rank5/owner") == b""  # a spare node started as node 5 stands by again

        assert not node0.judge._spare_node_takes(0, 2, CAUSE, node0.store)  # its second death: the restart
        assert spare_node_agent.standing(node0.store, node0.nodes.roster(0)) == [3]  # node 0 waits for no dead one's goodbye
        # the job's end releases the spare node still standing by
        node0.handle({"cmd": "linger", "attempt": 0, "timeout": 0.1})
        assert wait_for(lambda: spares[3][1][-1]["event"] == "spare-closed", timeout=10)
    finally:
        StoreCalls(server).set(spare_node_agent.CLOSED_KEY, b"1")


def test_no_spare_node_free_leaves_the_death_to_the_restart(free_tcp_port):
    server = TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    try:
        _round(server, [1, 1, 1])
        node0, _ = _agent(free_tcp_port, 0)
        assert not node0.judge._spare_node_takes(0, 2, CAUSE, node0.store)  # --spare-nodes 0
        node0.nodes.spare_nodes = 1
        assert not node0.judge._spare_node_takes(0, 2, CAUSE, node0.store)  # none stands by
        spare, events = _agent(free_tcp_port, 3)
        _stand_by(spare, 1)
        assert wait_for(lambda: events and events[-1]["event"] == "standing-by", timeout=10)
        StoreCalls(server).set("a0/live1", orjson.dumps({"node": 1, "rank": 1}))
        assert not node0.judge._spare_node_takes(0, 0, CAUSE, node0.store)  # node 0 cannot be replaced
    finally:
        StoreCalls(server).set(spare_node_agent.CLOSED_KEY, b"1")


def test_a_spare_node_with_other_settings_is_refused_alone_and_one_follows_the_rounds(free_tcp_port):
    server = TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    try:
        _round(server, [1, 1])
        other, events = _agent(free_tcp_port, 2)
        _stand_by(other, 1, fingerprint="f2")
        assert wait_for(lambda: events and events[-1]["event"] == "spare-refused", timeout=10)
        assert events[-1]["message"].startswith("node 2 (h) runs other model/training/data settings than node 0")
        assert events[-1]["message"].endswith(": this spare node does not stand by for the job")
        assert events[-1]["exit_code"] == 2

        spare, events = _agent(free_tcp_port, 3)
        _stand_by(spare, 1)
        assert wait_for(lambda: events and events[-1]["event"] == "standing-by", timeout=10)
        StoreCalls(server).set("a0/abort", orjson.dumps(CAUSE))  # the round ends (a restart) ...
        StoreCalls(server).set("a1/nodes", orjson.dumps([{**NODE, "node": r, "nproc": 1} for r in (0, 1)]))
        StoreCalls(server).set("a1/all", JOINED)  # ... and the next one runs: it stands by there
        assert wait_for(lambda: events[-1]["event"] == "standing-by" and events[-1]["attempt"] == 1, timeout=10)
        StoreCalls(server).set("a1/promote3", b"\x00not a promotion")  # no gpuherd node writes that
        assert wait_for(lambda: events[-1]["event"] == "spare-refused", timeout=10)
        assert "key a1/promote3 holds" in events[-1]["message"] and events[-1]["exit_code"] == 1
    finally:
        StoreCalls(server).set(spare_node_agent.CLOSED_KEY, b"1")
