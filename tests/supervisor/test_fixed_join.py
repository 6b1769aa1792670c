"""A fixed-size job's join (fixed_join.py) on a real TCPStore in this process, one client per node
as on a cluster: node 0 alone asks about every record key; the others wait on one key, so the
store parses O(N) keys per join, not N x N; a node's abort ends node 0's gathering; a missing
node is named after one join timeout, not two."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import orjson
import pytest
from torch.distributed import TCPStore

from supervisor.rendezvous import fixed_join
from supervisor.rendezvous.beat_watch import abort_key, all_key, node_key, publish
from supervisor.rendezvous.store_calls import StoreCalls

NODES = 8


class CountingStore:
    """One node's client, counting the record keys it asks about (check and wait)."""

    def __init__(self, port: int, keys_asked: Counter, node: int) -> None:
        self.store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        self.keys_asked, self.node = keys_asked, node

    def check(self, keys: list[str]) -> bool:
        self.keys_asked[self.node] += len(keys)
        return self.store.check(keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.keys_asked[self.node] += len(keys)
        self.store.wait(keys, timeout)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


@pytest.fixture
def server(free_tcp_port):
    return TCPStore("127.0.0.1", free_tcp_port, None, True, timedelta(seconds=30), wait_for_workers=False)


def _record(r: int) -> bytes:
    return orjson.dumps({"host": f"h{r}", "nproc": 2, "node": r})


def _join_all(port: int, nodes: list[int], timeout: float, asked: Counter) -> dict[int, fixed_join.Joined]:
    got: dict[int, fixed_join.Joined] = {}

    def one(r: int) -> None:
        store = StoreCalls(CountingStore(port, asked, r))
        got[r] = fixed_join.join(store, 0, r, NODES, _record(r), timeout, f"node {r}")

    threads = [threading.Thread(target=one, args=(r,)) for r in nodes]
    for t in reversed(threads):  # node 0 first or last makes no difference; here it enters last
        t.start()
    for t in threads:
        t.join(timeout + 20)
    return got


def test_every_node_gets_every_record_and_only_node_0_asks_about_all_the_keys(server):
    asked: Counter = Counter()
    got = _join_all(server.port, list(range(NODES)), 20.0, asked)
    assert sorted(got) == list(range(NODES))
    for r in range(NODES):
        assert [rec["node"] for rec in got[r].records] == list(range(NODES))
    assert asked[0] >= NODES
    # every other node asked about one key at a time (all_key): never the N record keys
    others = [asked[r] for r in range(1, NODES)]
    assert max(others) <= 3, asked


def test_a_node_failing_before_the_join_completes_ends_node_0s_gathering_at_once(server):
    store = StoreCalls(server)
    cause = {"kind": "worker", "exit_code": 1, "message": "node 3 failed before the join completed"}
    threading.Timer(0.5, lambda: publish(store, 0, cause)).start()
    t0 = time.monotonic()
    got = fixed_join.join(StoreCalls(CountingStore(server.port, Counter(), 0)), 0, 0, NODES, _record(0), 30.0,
                          "node 0")
    assert time.monotonic() - t0 < 10  # the abort is seen between two of node 0's 1 s waits, not at 30 s
    assert got.abort is not None and orjson.loads(got.abort)["message"] == cause["message"]
    assert server.get(all_key(0)) == b"abort" and server.check([abort_key(0)])


def test_a_missing_node_is_named_by_node_0_after_one_join_timeout(server):
    asked: Counter = Counter()
    t0 = time.monotonic()
    got = _join_all(server.port, [r for r in range(NODES) if r != 5], 3.0, asked)
    assert time.monotonic() - t0 < 3.0 * 2  # not the join timeout twice over on node 0
    assert got[0].missing == [5]
    assert all(got[r].missing == [5] for r in got)
    assert not server.check([node_key(0, 5)])
