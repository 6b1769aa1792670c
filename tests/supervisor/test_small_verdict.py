"""Node 0's verdict (supervisor/rendezvous/verdict.py) is the same few dozen bytes at 16 nodes
and at 4,096 when nobody is dead, and an `alive` check on a survivor decides from it as it did
from a seq per node: never a node counted alive that a seq of its own would not prove."""

from __future__ import annotations

import random

import orjson

from supervisor.rendezvous.beat_watch import BeatWatch
from supervisor.rendezvous.node_agent_main import Agent
from supervisor.rendezvous.verdict import parse_verdict, summary, undecided
from tests.supervisor.test_node_agent_data import DictStore


def _watched(n: int, reads: int, still: frozenset[int] = frozenset()) -> BeatWatch:
    """Node 0's reading after `reads` reads of n nodes' beats, each beating once between reads
    but those in `still`, whose beat never moves after the first read."""
    beats = BeatWatch(0)
    others = list(range(1, n))
    for i in range(reads):
        beats.observe(others, [b"1" if r in still else str(i).encode() for r in others], float(i))
    return beats


def test_the_verdict_is_the_same_size_at_16_nodes_and_at_4096_when_nobody_is_dead():
    small = orjson.dumps(_watched(16, 3).verdict(range(16)))
    large = orjson.dumps(_watched(4096, 3).verdict(range(4096)))
    assert len(small) == len(large) < 64  # was 8 bytes a node: {"moved": {"1": 3, ...}}
    assert orjson.loads(large) == {"seq": 3, "floor": 3, "late": {}, "dead": []}


def test_a_dead_node_costs_its_cause_and_a_stalled_one_its_seq_whatever_the_nodes():
    for n in (16, 4096):
        beats = _watched(n, 4, still=frozenset({7}))
        beats.dead[9] = {"kind": "node", "node": 9, "message": "node 9 (h9) stopped responding"}
        v = beats.verdict(range(n))
        assert v["late"] == {"7": 1} and v["floor"] == 4 and [c["node"] for c in v["dead"]] == [9]
    assert len(orjson.dumps(_watched(16, 4).verdict(range(16)))) < 64


def test_a_node_whose_beat_missed_one_read_is_not_late_but_holds_the_floor_back():
    beats = BeatWatch(0)
    beats.observe([1, 2], [b"1", b"1"], 0.0)
    beats.observe([1, 2], [b"2", b"2"], 1.0)
    beats.observe([1, 2], [b"3", b"2"], 2.0)  # node 2's beat fell just after this read
    v = beats.verdict([0, 1, 2])
    assert v["late"] == {} and v["floor"] == 2 and v["seq"] == 3
    assert undecided(v, 0, [1, 2]) == []  # each moved in read 2 or 3: after read 1
    assert undecided(v, 1, [1, 2]) == [1, 2]  # read 2 may be node 2's (it is): not proven after read 2
    beats.observe([1, 2], [b"4", b"4"], 3.0)
    assert undecided(beats.verdict([0, 1, 2]), 1, [1, 2]) == []


def test_a_member_node_0_never_read_is_late_from_read_0_as_it_had_no_seq_before():
    beats = _watched(3, 5)  # nodes 1 and 2 read; node 3 a member it does not read (the job went on without it)
    v = beats.verdict([0, 1, 2, 3])
    assert v["late"] == {"3": 0} and undecided(v, 1, [1, 2, 3]) == [3]


def _old_undecided(seq: int, moved: dict[int, int], dead: set[int], seq0: int, ranks: list[int]) -> list[int]:
    """What the check decided from node 0's former verdict, a seq for every node."""
    return [r for r in ranks if r not in dead and moved.get(r, 0) < seq0 + 2]


def test_the_check_counts_no_node_alive_that_a_seq_per_node_would_not_and_agrees_once_a_read_later():
    rng = random.Random(45)
    for _ in range(2000):
        n, seq = rng.randint(2, 40), rng.randint(0, 12)
        members = list(range(n))
        moved = {r: rng.choice([seq, seq, seq, max(0, seq - 1), rng.randint(0, seq)]) for r in members[1:]
                 if rng.random() > 0.05}  # now and then a member never read
        dead = {r for r in members[1:] if rng.random() < 0.05}
        v = summary(seq, moved, {r: {"node": r, "message": f"node {r}"} for r in dead}, members)
        assert parse_verdict(orjson.dumps(v)) == v
        for seq0 in range(0, seq + 1):
            ranks = [r for r in members[1:] if rng.random() > 0.1]
            new, old = undecided(v, seq0, ranks), _old_undecided(seq, moved, dead, seq0, ranks)
            assert set(old) <= set(new)
            if seq >= seq0 + 3 or v["floor"] == seq:
                assert new == old


def test_a_value_node_0_never_writes_is_no_verdict():
    for raw in (b"[1]", b'{"seq": 3, "moved": {}, "dead": []}', b'{"seq": 3, "floor": -1, "late": {}, "dead": []}',
                b'{"seq": 3, "floor": 3, "late": {"1": "x"}, "dead": []}', b"\xff"):
        assert parse_verdict(raw) is None, raw


class _Reads(DictStore):
    """A store that counts the bytes of node 0's verdict each read brings back."""

    def __init__(self, values: dict[str, bytes]) -> None:
        super().__init__(values)
        self.verdict_reads: list[int] = []
        self.verdict_checks = 0

    def check(self, keys: list[str]) -> bool:
        self.verdict_checks += keys == ["a0/verdict"]
        return super().check(keys)

    def get(self, key: str) -> bytes:
        if key == "a0/verdict":
            self.verdict_reads.append(len(self.values[key]))
        return super().get(key)


def test_a_survivor_of_4096_nodes_answers_from_one_small_read_a_second():
    n = 4096
    beats = _watched(n, 5)
    store = _Reads({"a0/verdict": orjson.dumps(beats.verdict(range(n)))})
    agent = Agent(store, node_rank=1, nnodes=n, join_timeout=1.0, where="10.0.0.1:29500")
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    agent.handle({"cmd": "alive", "attempt": 0})
    agent.poll()  # its first read: node 0's seq 5 when the check began
    assert events == []
    others = list(range(1, n))
    for i in range(5, 7):  # node 0's reads 6 and 7: every node moved since the check began
        beats.observe(others, [str(i).encode()] * len(others), float(i))
        store.values["a0/verdict"] = orjson.dumps(beats.verdict(range(n)))
        agent.next_beat = 0.0
        agent.poll()
    assert events == [{"event": "alive", "attempt": 0, "silent": []}]
    assert len(store.verdict_reads) == 3 and max(store.verdict_reads) < 64  # was 3 x ~40 KB at 4,096 nodes
    assert store.verdict_checks == 1  # the key, once seen, stays set: each later read is one `get`


def test_a_survivor_waits_for_a_node_that_stood_still_and_answers_when_node_0_names_it():
    n = 64
    beats = _watched(n, 5, still=frozenset({7}))
    store = _Reads({"a0/verdict": orjson.dumps(beats.verdict(range(n)))})
    agent = Agent(store, node_rank=1, nnodes=n, join_timeout=1.0, where="10.0.0.1:29500")
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    agent.handle({"cmd": "alive", "attempt": 0})
    others = list(range(1, n))
    for i in range(5, 8):
        agent.next_beat = 0.0
        agent.poll()
        beats.observe(others, [b"1" if r == 7 else str(i).encode() for r in others], float(i))
        store.values["a0/verdict"] = orjson.dumps(beats.verdict(range(n)))
    assert events == []  # node 7's beat stood still since read 1: not proven alive
    dead = {"kind": "node", "exit_code": 1, "node": 7, "message": "node 7 (h7) stopped responding"}
    beats.dead[7] = dead
    store.values["a0/verdict"] = orjson.dumps(beats.verdict(range(n)))
    agent.next_beat = 0.0
    agent.poll()
    assert events == [{"event": "alive", "attempt": 0, "silent": [dead]}]
    assert 7 in agent.nodes.gone


def test_node_0_reading_four_times_a_second_lists_no_node_beating_once_a_second_as_late():
    """During an `alive` check node 0 reads every 0.25 s; a node whose own check ended beats once a
    second again: it stands still for three reads, not 1.5 s, so the verdict stays small. A node
    still for 1.5 s is late whatever the reading pace, with the read it last moved in."""
    beats = BeatWatch(0)
    for i in range(12):  # 3 s of reads every 0.25 s; node 1 beats every 0.25 s, node 2 once a second
        now = 0.25 * i
        beats.observe([1, 2, 3], [str(i).encode(), str(int(now)).encode(), b"1"], now)
    v = beats.verdict([0, 1, 2, 3])
    assert v["late"] == {"3": 1} and v["seq"] == 12  # node 3 never moved after the first read
    assert v["floor"] == 9  # node 2 last moved at 2.0 s: read 9
    assert undecided(v, 6, [1, 2, 3]) == [3]  # nodes 1 and 2 moved after read 7; node 3 not
    assert len(orjson.dumps(v)) < 64
