"""Node 0's own stalls (supervisor/rendezvous/own_lag.py) are never read as another node's
death: the time node 0 stood still is nobody's silence, and a node lost during a stall long
enough for every node to give node 0 up names node 0, never the healthy node."""

from __future__ import annotations

import orjson

from supervisor.rendezvous.beat_watch import SILENT_S, BeatWatch, beat_key
from supervisor.rendezvous.node_agent_main import Agent
from supervisor.rendezvous.own_lag import STALL_S, OwnLag
from tests.supervisor.test_node_agent_data import DictStore


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lag() -> tuple[OwnLag, Clock]:
    clock = Clock()
    return OwnLag(clock, start=False), clock


def test_a_gap_in_the_ticks_is_a_stall_counted_once():
    lag, clock = _lag()
    for _ in range(8):  # a busy host's late ticks are no stall
        clock.now += 0.3
        lag.tick()
    assert lag.stalled_within(5.0) is None and lag.take_new() == 0.0
    clock.now += 12.0
    lag.tick()
    assert lag.stalled_within(5.0) == 12.0
    assert lag.take_new() == 12.0 and lag.take_new() == 0.0  # handed over once
    clock.now += 6.0
    lag.tick()
    assert lag.stalled_within(5.0) == 6.0  # the newer stall; the 12 s one ended over 5 s ago


def test_a_stall_still_going_on_is_seen_before_the_ticker_runs_again():
    lag, clock = _lag()
    clock.now += STALL_S + 9
    assert lag.stalled_within(5.0) == STALL_S + 9  # another thread asks first, as the liveness thread may
    assert lag.take_new() == STALL_S + 9


def test_node_0s_stall_is_no_nodes_silence():
    beats = BeatWatch(0)
    assert beats.observe([1, 2], [b"5", b"5"], now=0.0) == []
    beats.pause(12.0)  # node 0 stood still from about 0.5 s to 12.5 s: it read nothing meanwhile
    assert beats.observe([1, 2], [b"5", b"5"], now=12.5) == []
    assert [r for r, _ in beats.observe([1, 2], [b"5", b"6"], now=12.0 + SILENT_S + 1)] == [1]  # then counted


class BeatStore(DictStore):
    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[key] for key in keys]


def _node0(clock: Clock) -> tuple[Agent, list[dict], BeatStore]:
    store = BeatStore({beat_key(0, r): b"3" for r in (1, 2, 3)})
    agent = Agent(store, node_rank=0, nnodes=4, join_timeout=1.0, where="10.0.0.1:29500")
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    agent.nodes.hosts = {0: "h0", 1: "h1", 2: "h2", 3: "h3"}
    agent.judge.beats = BeatWatch(0)
    agent.own_lag = OwnLag(clock, start=False)
    agent.connect = lambda: store
    return agent, events, store


def _run_for(agent: Agent, clock: Clock, seconds: float) -> None:
    """Node 0 running (its ticker ticking) for `seconds`."""
    for _ in range(int(seconds / 0.25)):
        clock.now += 0.25
        agent.own_lag.tick()


def test_a_node_whose_connection_closed_during_node_0s_stall_is_not_blamed():
    """Node 0's agent SIGSTOPped 12 s: every other node's store watchdog gave it up after 10 s and
    ended, closing its connection; node 0, running again, names itself, not node 2."""
    clock = Clock()
    agent, events, store = _node0(clock)
    clock.now += 12.0  # the liveness thread runs first after SIGCONT
    agent.judge.connection_closed(2, None)
    abort = orjson.loads(store.values["a0/abort"])
    assert abort["node"] == 0 and abort["message"].startswith("node 0 (h0) stopped responding: its node agent did "
                                                              "not run for 12.0 s")
    assert "node 2's connection closed then: a consequence, not a cause" in abort["message"]
    assert [e["cause"]["node"] for e in events if e["event"] == "abort"] == [0]


def test_a_short_stall_of_node_0_leaves_a_real_death_named():
    """A stall shorter than the other nodes' patience ended nobody: a connection that closes
    after it is that node's own death."""
    clock = Clock()
    agent, _events, store = _node0(clock)
    clock.now += 4.0
    agent.own_lag.tick()
    _run_for(agent, clock, 1.0)  # within the margin after it: the stall's length decides
    agent.judge.connection_closed(2, None)
    abort = orjson.loads(store.values["a0/abort"])
    assert abort["node"] == 2 and "its connection to node 0 closed without a goodbye" in abort["message"]


def test_node_0s_beat_reading_after_a_stall_names_nobody():
    clock = Clock()
    agent, events, store = _node0(clock)
    agent.nodes.members = [0, 1, 2, 3]
    agent.judge.read_beats(clock.now)
    clock.now += 12.0
    agent.judge.read_beats(clock.now)
    assert "a0/abort" not in store.values and events == []
    _run_for(agent, clock, SILENT_S + 1)  # still no beat, node 0 running all along: now they are silent
    agent.judge.read_beats(clock.now)
    assert orjson.loads(store.values["a0/abort"])["node"] == 1
