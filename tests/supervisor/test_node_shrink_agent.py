"""A node lost whole with no spare node free (node_shrink_agent.py), judged by node 0's agent on a
real TCPStore in this process: with --min-replicas it claims a shrink of the dead node's ranks
(the ranks training now: an earlier shrink counts) instead of publishing the abort, and stops
waiting for that node (its beat, `done`, `outcome`); below the floor, on node 0 or with
shrinking off, the death is the round's abort (saying why, below the floor); a free spare
node is preferred over a shrink."""

from __future__ import annotations

from datetime import timedelta

import orjson
import pytest
from torch.distributed import TCPStore

from supervisor.rendezvous import node_shrink_agent, spare_node_agent
from supervisor.rendezvous.node_shrink_agent import Shrink
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.beat_watch import SILENT_S, BeatWatch
from supervisor.rendezvous.store_calls import StoreCalls
from tests.supervisor.helpers import wait_for
from tests.supervisor.agent_helpers import quick_spares  # noqa: F401 (a fixture the next one uses)
from tests.supervisor.test_spare_node_agent import CAUSE, _agent, _quick_spares, _round, _stand_by  # noqa: F401


@pytest.fixture
def server(free_tcp_port):
    store = TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield store
    StoreCalls(store).set(spare_node_agent.CLOSED_KEY, b"1")  # a spare node standing by leaves


def _node0(port: int, min_replicas: int):
    node0, events = _agent(port, 0)
    node0.nodes.min_replicas = min_replicas
    node0.judge.beats = BeatWatch(0)
    node0.nodes.hosts = {0: "h0", 1: "h1", 2: "h2"}
    return node0, events


def test_a_dead_node_with_no_spare_node_shrinks_the_job_onto_the_ranks_still_training(server, free_tcp_port):
    _round(server, [1, 2, 2])  # ranks 0 | 1, 2 | 3, 4
    store = StoreCalls(server)
    earlier = {"node": 1, "rank": 2, "action": "shrink", "decision": {"shrink": 2, "ranks": [0, 1, 3, 4]}}
    store.set("a0/live1", orjson.dumps(earlier))  # node 1 lost rank 2 with no spare left
    node0, events = _node0(free_tcp_port, 2)

    node0.judge._declare(0, 2, dict(CAUSE), node0.store)
    assert not store.check(["a0/abort"]) and not events  # no abort: the job goes on
    claim = orjson.loads(store.get("a0/live2"))  # the round's next rebuilt group
    assert (claim["node"], claim["rank"], claim["ranks"], claim["kind"], claim["action"]) == (2, 3, [3, 4], "node",
                                                                                               "shrink")
    assert claim["decision"] == {"shrink": 3, "ranks": [0, 1]} and claim["failed"] == CAUSE["message"]
    assert node0.nodes.lost_nodes == {2} and 2 in node0.nodes.gone

    node0.judge._declare(0, 2, dict(CAUSE), node0.store)  # named again (its silence after its closed connection)
    assert not store.check(["a0/abort", "a0/live3"])

    # node 0 no longer reads its beat, waits for its `done` or its outcome
    store.set("a0/beat1", b"1")
    node0.judge.read_beats(100.0)
    store.set("a0/beat1", b"2")
    node0.judge.read_beats(100.0 + SILENT_S + 5)
    assert not store.check(["a0/abort"]) and node0.judge.beats.dead == {}
    store.set("a0/done0", b"1")
    store.set("a0/done1", b"1")
    node0.handle({"cmd": "wait-done", "attempt": 0, "timeout": 5.0})
    assert events[-1] == {"event": "finished", "attempt": 0, "missing": []}
    store.set("outcome1", orjson.dumps({"node": 1, "exit_code": 0, "outcome": "completed"}))
    node0.handle({"cmd": "outcomes", "timeout": 5.0})
    one, two = events[-1]["nodes"]
    assert one["exit_code"] == 0 and two["node"] == 2 and two["outcome"].startswith("lost (h2): it died whole")


def test_below_the_floor_the_death_is_the_abort_and_says_why(server, free_tcp_port):
    _round(server, [1, 1, 1])
    node0, events = _node0(free_tcp_port, 3)
    node0.judge._declare(0, 2, dict(CAUSE), node0.store)
    (abort,) = events
    assert abort["event"] == "abort" and abort["cause"]["kind"] == "node"
    assert abort["cause"]["message"] == (f"{CAUSE['message']}; no spare node free, and the 2 rank(s) left on the "
                                         "other nodes are fewer than --min-replicas 3: the job cannot go on without "
                                         "it (a restart, if one is left)")
    assert not StoreCalls(server).check(["a0/live1"]) and node0.nodes.lost_nodes == set()


def test_node_0_or_shrinking_off_leaves_the_death_to_the_restart(server, free_tcp_port):
    _round(server, [1, 1, 1])
    node0, _ = _node0(free_tcp_port, 2)
    assert not node0.judge._shrink_without(0, 0, dict(CAUSE), node0.store)  # it hosts the stores
    node0.nodes.min_replicas = 0
    assert not node0.judge._shrink_without(0, 2, dict(CAUSE), node0.store)
    assert not StoreCalls(server).check(["a0/live1"])
    StoreCalls(server).set("a0/live1", b"\x00not a claim")  # no gpuherd node writes that: the restart
    node0.nodes.min_replicas = 2
    assert not node0.judge._shrink_without(0, 2, dict(CAUSE), node0.store)


def test_a_free_spare_node_takes_the_dead_nodes_place_before_any_shrink(server, free_tcp_port):
    _round(server, [1, 1, 1])
    node0, events = _node0(free_tcp_port, 2)
    node0.nodes.spare_nodes = 1
    spare, spare_events = _agent(free_tcp_port, 3)
    _stand_by(spare, 1)
    assert wait_for(lambda: spare_events and spare_events[-1]["event"] == "standing-by", timeout=10)

    node0.judge._declare(0, 2, dict(CAUSE), node0.store)
    claim = orjson.loads(StoreCalls(server).get("a0/live1"))
    assert claim["spare_node"] == 3 and "action" not in claim and node0.nodes.lost_nodes == set() and not events
    assert wait_for(lambda: spare_events[-1]["event"] == "promoted", timeout=10)


def test_the_shrink_is_judged_from_a_roster_and_comes_back_as_a_value_for_node_0_to_apply(server):
    """node_shrink_agent.py never sees the agent: it reads the store and a frozen Roster, claims the
    shrink or says why not, and node 0's agent applies the answer to its own sets."""
    _round(server, [1, 1, 1])
    store = StoreCalls(server)
    below = node_shrink_agent.shrink_over(store, Roster(0, 3, min_replicas=3), 2, "node 2 died")
    assert below == Shrink(False, "; no spare node free, and the 2 rank(s) left on the other nodes are fewer "
                                  "than --min-replicas 3: the job cannot go on without it (a restart, if one is left)")
    assert node_shrink_agent.shrink_over(store, Roster(0, 3, min_replicas=2, elastic=True), 2, "x") == Shrink(False)
    assert not store.check(["a0/live1"])
    assert node_shrink_agent.shrink_over(store, Roster(0, 3, min_replicas=2), 2, "node 2 died") == Shrink(True)
    claim = orjson.loads(store.get("a0/live1"))
    assert (claim["failed"], claim["decision"]) == ("node 2 died", {"shrink": 2, "ranks": [0, 1]})
