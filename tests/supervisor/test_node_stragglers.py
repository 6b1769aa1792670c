"""A whole node slower than the other nodes, named on node 0 (supervisor/health/node_stragglers.py),
from the paces every node sends at each window it closes (supervisor/health/stragglers.py) over
the relay that carries the console lines (supervisor/output/node_relay.py)."""

from __future__ import annotations

import orjson
import pytest

from gpuherd.status_records import Alive, Straggler, decode
from supervisor.health import NodeStragglers, Stragglers, pace_record, read_pace
from supervisor.output import NodeRelay
from supervisor.summary import Summary


def _judge(windows: int = 3, factor: float = 1.3) -> tuple[NodeStragglers, list, list]:
    written, warned = [], []
    return NodeStragglers(factor, windows, written.append, window_s=5.0, warn=warned.append), written, warned


def _feed(judge: NodeStragglers, paces: dict[int, list[float]], start: float = 0.0) -> None:
    """Each node's pace every 5 s, the nodes' windows closing at their own moments."""
    for i in range(max(len(p) for p in paces.values())):
        for node, seq in paces.items():
            if i < len(seq):
                judge.add(node, seq[i], start + 5.0 * i + 0.3 * node)
        judge.tick(start + 5.0 * i + 2.0)


def test_a_node_slower_than_the_others_for_three_of_its_windows_is_named_once_with_every_nodes_pace():
    judge, written, warned = _judge()
    _feed(judge, {0: [0.10] * 8, 1: [0.10, 0.10, 0.41, 0.40, 0.42, 0.40, 0.40, 0.40], 2: [0.11] * 8})
    assert len(warned) == 1, warned
    line = warned[0]
    assert line.startswith("straggler: node 1 computes 4.00x slower than the median of the other nodes (420 ms vs "
                           "105 ms per step")
    assert "node 0 100 ms, node 1 420 ms, node 2 110 ms" in line and "moved out" not in line  # no mover here
    (rec,) = written
    assert rec["node"] == 1 and rec["rank"] is None and rec["slowdown"] == 4.0 and rec["windows"] == 3
    assert judge.found == written
    read = decode(orjson.dumps(rec), supervisor=True)  # metrics.jsonl's reader takes it as it is
    assert isinstance(read, Straggler) and read.node == 1 and read.rank is None and not read.refused


def test_two_nodes_the_slow_one_is_named_and_the_fast_one_never():
    judge, written, warned = _judge()
    _feed(judge, {0: [0.05] * 6, 1: [0.20] * 6})
    assert [r["node"] for r in written] == [1] and len(warned) == 1


@pytest.mark.parametrize("paces", [
    {0: [0.10] * 10, 1: [0.12] * 10, 2: [0.09] * 10},  # noise under the factor
    {0: [0.10] * 10, 1: [0.20, 0.20, 0.10, 0.20, 0.20, 0.10, 0.20, 0.20, 0.10, 0.20], 2: [0.10] * 10},  # never 3 in a row
])
def test_no_node_is_named_under_the_factor_or_for_fewer_windows_in_a_row(paces):
    judge, written, warned = _judge()
    _feed(judge, paces)
    assert written == [] and warned == []


def test_a_node_back_to_pace_and_slow_again_is_named_again():
    judge, written, _ = _judge(windows=2)
    _feed(judge, {0: [0.1] * 9, 1: [0.3, 0.3, 0.3, 0.1, 0.1, 0.3, 0.3, 0.1, 0.1]})
    assert [r["node"] for r in written if isinstance(r, dict)] == [1, 1]
    assert [r.node for r in _timeline(written)] == [1, 1]  # each stretch costed when it ended


def test_a_pace_judged_once_only_and_a_node_silent_for_two_windows_is_no_baseline():
    judge, written, _ = _judge(windows=2)
    judge.add(0, 0.1, 0.0)
    judge.add(1, 0.5, 0.1)
    for t in (1.0, 2.0, 3.0, 4.0):  # many looks, one new pace each: one window counted, not four
        judge.tick(t)
    assert written == []
    judge.add(1, 0.5, 5.1)  # node 0's last pace came 5.1 s ago: still a baseline
    judge.tick(5.5)
    assert [r["node"] for r in written] == [1]
    judge2, written2, _ = _judge(windows=1)
    judge2.add(0, 0.1, 0.0)
    judge2.add(1, 0.5, 10.5)  # node 0 silent for more than two windows: nothing to compare with
    judge2.tick(10.6)
    assert written2 == []


def test_straggler_factor_0_turns_the_node_judge_off_too():
    judge, written, _ = _judge(factor=0.0)
    _feed(judge, {0: [0.1] * 6, 1: [1.0] * 6})
    assert written == []


@pytest.mark.parametrize("junk", [{"pace": "fast", "steps": 3}, {"pace": -1.0, "steps": 3}, {"pace": 0.1},
                                  {"pace": True, "steps": 1}, {"pace": 0.1, "steps": 2.5}, ["pace", 0.1], "pace"])
def test_a_relayed_record_that_is_no_pace_is_not_read_as_one(junk):
    assert read_pace(junk) is None
    assert read_pace(pace_record(0.1234567, 4)) == (0.123457, 4)


def test_a_node_of_one_rank_sends_its_pace_and_a_node_of_several_sends_its_ranks_median():
    sent: list[tuple[float, int]] = []
    one = Stragglers(1.3, 3, write=lambda rec: None, window_s=5.0, pace=lambda c, s: sent.append((c, s)), solo=True)
    for second in range(1, 12):
        one.add(0, Alive(steps=4, compute_s=0.2), float(second))
        one.tick(float(second))
    # a window every 5 s (the first from the first record, at 1 s, to 6 s), of one rank: nobody to compare it with
    assert sent == [(pytest.approx(0.05), 24), (pytest.approx(0.05), 20)]
    sent.clear()
    three = Stragglers(1.3, 3, write=lambda rec: None, window_s=5.0, pace=lambda c, s: sent.append((c, s)))
    for second in range(1, 7):
        for rank, compute in ((0, 0.1), (1, 0.3), (2, 0.2)):
            three.add(rank, Alive(steps=2, compute_s=compute), float(second))
        three.tick(float(second))
    assert sent == [(pytest.approx(0.1), 12)]  # the median of 0.05, 0.15, 0.1; 6 records of 2 steps each
    sent.clear()
    two = Stragglers(1.3, 3, write=lambda rec: None, window_s=5.0, pace=lambda c, s: sent.append((c, s)))
    for second in range(1, 12):  # rank 1's records are late: a node of two ranks waits for both
        two.add(0, Alive(steps=2, compute_s=0.1), float(second))
        if second > 8:
            two.add(1, Alive(steps=2, compute_s=0.1), float(second))
        two.tick(float(second))
    assert sent == [(pytest.approx(0.05), 2)]  # one window, closed at 9 s with both ranks in it (rank 1: 2 steps)


def test_the_relay_hands_paces_to_node_0s_judge_and_lines_to_the_folding_point():
    sent: list[list] = []
    printed: list[bytes] = []
    judge, written, _ = _judge(windows=1)
    relay = NodeRelay(lambda fd, data: printed.append(data))
    receive = {}

    def link(callback):
        receive["to"] = callback
        return sent.append

    lines = relay.attempt(link, world_size=2, paces=judge)
    assert lines is not None
    relay.pace(0.25, 7)
    assert sent == [[{"pace": 0.25, "steps": 7}]]
    line = {"fd": 2, "node": 1, "kind": "CPU", "devices": [0], "ranks": [1], "key": "k", "text": "hello\n"}
    receive["to"](1, [{"pace": 0.4, "steps": 3}, line])
    receive["to"](0, [{"pace": 0.1, "steps": 3}])
    judge.tick(1e9)  # long after: nothing recent
    assert written == []
    relay.close()
    assert b"hello" in b"".join(printed)  # the line went on to be printed, the paces did not
    assert judge._paces[1].compute_s == 0.4 and judge._paces[0].compute_s == 0.1


def test_the_summary_names_a_slow_node_as_a_node():
    summary = Summary.__new__(Summary)
    summary.stragglers = [{"node": 1, "rank": None, "slowdown": 3.8, "reason": None},
                          {"rank": 2, "slowdown": 1.5, "reason": "thermal slowdown"},
                          {"node": 1, "rank": None, "slowdown": 4.1, "reason": None, "moved_out": True, "held_s": 30.2}]
    assert summary._straggler_lines() == ["straggler: node 1 computed 3.80x slower than the other nodes",
                                          "straggler: rank 2 computed 1.50x slower than the others "
                                          "(thermal slowdown)",
                                          "straggler: node 1 computed 4.10x slower than the other nodes for 30 s: "
                                          "moved out, a spare node took its place"]


def _mover(after_s: float = 30.0) -> tuple[NodeStragglers, list, list, list, list]:
    """A judge whose moves go to `asked` (as node 0's agent would get them)."""
    written, warned, said, asked = [], [], [], []
    judge = NodeStragglers(1.3, 3, written.append, window_s=5.0, warn=warned.append, move_factor=2.0,
                           move_after_s=after_s, info=said.append)
    judge.move = lambda node, message: asked.append((node, message))
    return judge, written, warned, said, asked


def test_a_node_over_the_move_factor_for_the_move_time_is_handed_to_node_0s_agent_once_and_moved_when_it_says_so():
    judge, written, _warned, said, asked = _mover()
    _feed(judge, {0: [0.10] * 6, 1: [0.40] * 6})  # 30 s over 2x: due at its 6th pace (window 25-30 s)
    assert [node for node, _ in asked] == [1]
    assert asked[0][1].startswith("node 1 computed 4.00x the median of the other nodes for 30 s (over 2x in every "
                                  "window; each node's ranks' median compute per step: node 0 100 ms, node 1 400 ms)")
    _feed(judge, {0: [0.10], 1: [0.40]}, start=30.0)
    assert len(asked) == 1  # no second ask while its answer is due
    judge.answered(1, None)
    judge.tick(36.0)
    (moved,) = [r for r in written if isinstance(r, dict) and r.get("moved_out")]
    assert moved["node"] == 1 and moved["held_s"] == 30.0 and moved["compute_ms_before"] == {"0": 100.0, "1": 400.0}
    assert any(line.startswith("straggler: node 1 moved out: told to leave, a spare node takes its place") for line in said)
    # the spare node in its place: its first window (its join) is not judged, its second is the outcome
    _feed(judge, {0: [0.10] * 8, 1: [0.90, 0.11, 0.10, 0.10, 0.10, 0.10, 0.10, 0.10]}, start=40.0)
    assert moved["compute_ms_after"] == {"0": 100.0, "1": 110.0}
    assert len(asked) == 1 and len([r for r in written if isinstance(r, dict) and r.get("moved_out")]) == 1
    assert judge.found.count(moved) == 1


def test_a_move_refused_is_said_once_per_reason_and_asked_again_at_the_next_window():
    judge, written, warned, _said, asked = _mover()
    _feed(judge, {0: [0.10] * 6, 1: [0.40] * 6})
    judge.answered(1, "no spare node in this job (--spare-nodes)")
    _feed(judge, {0: [0.10] * 3, 1: [0.40] * 3}, start=30.0)
    judge.answered(1, "no spare node in this job (--spare-nodes)")
    _feed(judge, {0: [0.10], 1: [0.40]}, start=45.0)
    assert [line for line in warned if "not moved out" in line] == [
        "straggler: node 1 not moved out: no spare node in this job (--spare-nodes)"]
    assert len(asked) == 3 and not [r for r in written if isinstance(r, dict) and r.get("moved_out")]


@pytest.mark.parametrize("slow", [
    [0.40, 0.40, 0.40, 0.40, 0.40, 0.15, 0.40, 0.40, 0.40, 0.40, 0.40],  # back under 2x once: its 30 s start again
    [0.19] * 12,  # named (1.9x) but never over the move factor
])
def test_a_node_is_not_moved_out_unless_it_stays_over_the_move_factor_for_the_whole_time(slow):
    judge, _written, _warned, _said, asked = _mover()
    _feed(judge, {0: [0.10] * len(slow), 1: slow})
    assert asked == []


def test_move_out_off_names_only():
    judge, written, warned, _said, asked = _mover(after_s=0)
    _feed(judge, {0: [0.10] * 10, 1: [0.40] * 10})
    assert asked == [] and [r["node"] for r in written] == [1] and len(warned) == 1


def _timeline(written: list) -> list:
    return [r for r in written if not isinstance(r, dict)]


def test_a_named_nodes_pace_is_costed_for_the_goodput_account_when_its_stretch_ends():
    """Each slow window costs the job its steps times the node's compute beyond the others' median
    (every other node's ranks waited that long): booked when it is back to pace, moved out, or the
    attempt ends, as a `timeline`/`straggler` record with `node` set (the goodput's `straggler`)."""
    judge, written, _warned = _judge()
    for i in range(6):  # 4 slow windows of 10 steps at 0.3 s vs 0.1 s, then back to pace
        slow = 1 <= i <= 4
        judge.add(0, 0.10, 5.0 * i, steps=10)
        judge.add(1, 0.30 if slow else 0.10, 5.0 * i + 0.3, steps=10)
        judge.tick(5.0 * i + 2.0)
    (stretch,) = _timeline(written)
    assert stretch.node == 1 and stretch.rank is None and not stretch.moved
    assert stretch.lost_s == 8.0  # 4 slow windows x 10 steps x 0.2 s beyond the others' (at most a window each)
    assert decode(orjson.dumps({"type": "timeline", "event": "straggler", "time": 1.0, "rank": None, "node": 1,
                                "since": 0.5, "lost_s": 8.0, "moved": False}), supervisor=True).node == 1


def test_a_node_moved_out_ends_its_stretch_as_moved_and_an_attempts_end_ends_any_other():
    judge, written, _warned, _said, _asked = _mover()
    _feed(judge, {0: [0.10] * 6, 1: [0.40] * 6})
    judge.answered(1, None)
    judge.tick(40.0)
    (moved,) = _timeline(written)
    assert moved.node == 1 and moved.moved
    judge2, written2, _w = _judge()
    _feed(judge2, {0: [0.10] * 5, 1: [0.40] * 5})
    judge2.close(30.0)
    (ended,) = _timeline(written2)
    assert ended.node == 1 and not ended.moved
