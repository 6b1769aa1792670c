"""Folding across nodes: each of 256 simulated nodes folds its 8 ranks' lines, sends each held
group to node 0 as one record (the wire form the agents carry), and node 0 prints a warning
that all 2,048 ranks printed as one line with the compact range form; errors and step lines
are printed where they happen, and every rank's log file keeps every line."""

from __future__ import annotations

import queue

import orjson

from supervisor.output.console import STDERR, STDOUT
from supervisor.output.cross_node import CrossNodeFolder, Group, decode
from supervisor.output.router import LogRouter, WorkerLog
from supervisor.rendezvous.liveness import LivenessLink, LivenessServer
from tests.supervisor.test_console_fold import WARNING, FakeConsole

NODES, PER_NODE = 256, 8


def _nodes(tmp_path, node0: CrossNodeFolder, consoles: list[FakeConsole], records: list[bytes]) -> list[LogRouter]:
    """One router per node; each held group goes over the wire (encoded, decoded) to node 0."""
    def relay(group: Group) -> None:
        records.append(group.encode())
        node0.add(decode(records[-1]), clock[0])

    routers = []
    for node in range(NODES):
        logs = [WorkerLog(node * PER_NODE + d, f"GPU{d}", tmp_path / f"worker-rank{node * PER_NODE + d}.log",
                          prefix=f"n{node}/GPU{d}:") for d in range(PER_NODE)]
        consoles.append(FakeConsole())
        routers.append(LogRouter(logs, consoles[-1], relay=relay))
    return routers


clock = [100.0]


def test_a_warning_from_every_one_of_2048_ranks_on_256_nodes_is_one_console_line(tmp_path):
    node0 = CrossNodeFolder(NODES * PER_NODE)
    consoles: list[FakeConsole] = []
    records: list[bytes] = []
    routers = _nodes(tmp_path, node0, consoles, records)
    for node, router in enumerate(routers):  # the nodes print it over 0.5 s, each rank within it
        clock[0] = 100.0 + node * 0.002
        for d in range(PER_NODE):
            router.feed(node * PER_NODE + d, STDERR, WARNING % d + b"\nINFO | Step [10/100] | Loss: 2.5\n", clock[0])
        router.tick(clock[0])
    routers[3].feed(3 * PER_NODE + 5, STDERR, b"ERROR | [GPU 5] NCCL watchdog timeout\n", clock[0])
    for router in routers:
        router.tick(clock[0] + 0.3)  # every node's own gap is over: its group went to node 0
    printed = [line for _, data in node0.due(clock[0] + 0.3) for line in data.splitlines()]

    assert printed == [b"n[0-255]/r[0-2047]:" + WARNING.replace(b"%d", b"*")]
    assert len(records) == NODES  # one record per node, not per rank
    # Step lines keep the per-rank rule and the error is printed at once on its node, never folded.
    assert consoles[3].lines.count(b"n3/GPU5:ERROR | [GPU 5] NCCL watchdog timeout") == 1
    assert all(c.lines.count(b"n%d/GPU%d:INFO | Step [10/100] | Loss: 2.5" % (n, d)) == 1
               for n, c in enumerate(consoles) for d in range(PER_NODE))
    assert not any(WARNING[:7] in line for c in consoles for line in c.lines)
    for router in routers:
        router.close()
    for rank in range(NODES * PER_NODE):  # every rank's file keeps every line
        node, d = divmod(rank, PER_NODE)
        text = (tmp_path / f"worker-rank{rank}.log").read_bytes()
        assert text.startswith(b"n%d/GPU%d:" % (node, d) + WARNING % d + b"\n")
        assert text.count(b"\n") == (3 if rank == 3 * PER_NODE + 5 else 2)


def test_a_line_one_node_printed_keeps_its_node_form_and_lone_lines_stay_verbatim():
    node0 = CrossNodeFolder(16, gap=0.2)
    node0.add(Group(STDOUT, 2, "GPU", (0, 1, 2), (16, 17, 18), b"ready [GPU *]", b"ready [GPU 0]"), 1.0)
    node0.add(Group(STDOUT, 5, "CPU", (3,), (43,), b"only me [CPU *]", b"only me [CPU 3]"), 1.0)
    node0.add(Group(STDOUT, 1, "GPU", (0, 1), (8, 9), b"ready [GPU *]", b"ready [GPU 0]"), 1.1)
    assert node0.due(1.25) == []  # the second node's copy extended the wait
    assert node0.due(1.35) == [(STDOUT, b"n[1-2]/r[8-9,16-18]:ready [GPU *]\n"),
                               (STDOUT, b"n5/CPU3:only me [CPU 3]\n")]
    node0.add(Group(STDOUT, 7, "GPU", (4, 5), (60, 61), b"x", b"x"), 2.0)
    assert node0.due(2.0, everything=True) == [(STDOUT, b"n7/GPU[4-5]:x\n")]


def test_a_record_no_node_wrote_is_left_out():
    assert decode(b"not json") is None
    assert decode(b'{"fd": 1, "node": 0, "kind": "GPU", "devices": [0], "ranks": [], "key": "", "text": ""}') is None
    group = Group(STDERR, 3, "GPU", (1,), (25,), b"\xff\xfe bytes [GPU *]", b"\xff\xfe bytes [GPU 1]")
    assert decode(group.encode()) == group  # any output round-trips


def test_a_nodes_lines_reach_node_0_over_its_direct_connection_not_the_store():
    got: queue.SimpleQueue = queue.SimpleQueue()
    server = LivenessServer("127.0.0.1", on_closed=lambda r, claim: got.put(("closed", r)),
                            on_lines=lambda r, payload: got.put((r, payload)))
    link = LivenessLink("127.0.0.1", server.port, 7, on_closed=lambda: None)
    group = Group(STDERR, 7, "GPU", (0, 1), (56, 57), b"warn [GPU *]", b"warn [GPU 0]")
    link.send_lines(b"[" + group.encode() + b"]")
    rank, payload = got.get(timeout=10)
    assert rank == 7 and [decode(d) for d in orjson.loads(payload)] == [group]
    link.bye()
    link.drop()
