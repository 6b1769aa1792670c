"""N simulated nodes on one host, sharing one process: the real node agent's decision code
(supervisor/rendezvous/node_agent_main.py `Agent`), one agent per simulated node with its
own store connections, its own threads and its own protocol state, against one real
`TCPStore` server (libuv) in a process of its own, as node 0's machine serves it.

What is replaced: the supervisor and its ranks. Each simulated node's thread feeds its
agent the commands its supervisor sends (join, watch, abort, ...) and records the events
the agent answers with, instead of the JSON lines on a pipe. Nothing trains.

The same harness runs torch's own c10d rendezvous (torch.distributed.elastic.rendezvous:
`DynamicRendezvousHandler` over `C10dRendezvousBackend`) per simulated node, polled as
torchrun's agent polls it (`num_nodes_waiting` every `monitor_interval`, 0.1 s) while
its keep-alive timer beats every 5 s.

Requests are counted by one wrapper class around every simulated node's store client
(`Counted`): one count per call the protocol makes, both sides through the same class,
so the comparison is like for like (torch's client sends a wait before each get and
multi_get, on both sides alike, which this count does not add).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import resource
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from supervisor.rendezvous.node_agent_main import Agent

HOST = "127.0.0.1"
JOIN_TIMEOUT_S = 600.0
STACK = 512 * 1024  # thousands of threads: a small stack each


class Requests:
    """Store calls of every simulated node, by operation."""

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, op: str) -> None:
        with self._lock:
            self.by_op[op] += 1

    def total(self) -> int:
        with self._lock:
            return sum(self.by_op.values())


class Counted:
    """A store client whose every call counts as one request."""

    def __init__(self, store: Any, requests: Requests) -> None:
        self._store, self._requests = store, requests

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._requests.add(name)
            return method(*args, **kwargs)
        return counted


def start_store_server() -> tuple[subprocess.Popen, int]:
    """The job store in a process of its own (its one libuv thread is the store host's CPU)."""
    code = ("import sys, time\nfrom datetime import timedelta\nfrom torch.distributed import TCPStore\n"
            "s = TCPStore('127.0.0.1', 0, None, True, timedelta(seconds=600), wait_for_workers=False)\n"
            "print(s.port, flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    return proc, int(proc.stdout.readline())


def client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(HOST, port, None, False, timedelta(seconds=JOIN_TIMEOUT_S))


def clients(port: int, count: int) -> list[Any]:
    """`count` store clients, made by many threads at once: about 3 % of torch's client connects
    take 5 s here (one at a time or not), so thousands made in turn would take minutes."""
    with ThreadPoolExecutor(max_workers=256) as pool:
        return list(pool.map(lambda _: client(port), range(count)))


def roomy() -> None:
    """Thousands of sockets and threads in one process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(STACK)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# ---------------------------------------------------------------------------- gpuherd
class SimNode:
    """One simulated node: its agent, driven like its supervisor drives it, in a thread of its own."""

    def __init__(self, r: int, n: int, port: int, requests: Requests, conns: list[Any]) -> None:
        """`conns`: this node's store connections, made beforehand (the first is its main one)."""
        self.r = r
        self.agent = Agent(Counted(conns.pop(), requests), r, n, JOIN_TIMEOUT_S, f"{HOST}:{port}")
        self.agent.connect = lambda: Counted(conns.pop() if conns else client(port), requests)
        self.agent.emit = self._on_event
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.commands: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.paused = False  # a dead node: no beat, no command
        if r == 0:
            self.agent.serve_liveness(HOST)
        self.thread = threading.Thread(target=self._serve, name=f"node{r}", daemon=True)
        self.thread.start()

    def _on_event(self, event: str, **fields: Any) -> None:
        if not self.paused:
            self.events.append((time.monotonic(), {"event": event, **fields}))

    def _serve(self) -> None:
        """The agent's own loop (`Agent.serve`), commands from a queue instead of stdin."""
        while True:
            try:
                msg = self.commands.get(timeout=max(0.01, self.agent._next_beat - time.monotonic()))
            except queue.Empty:
                msg = None
            else:
                if msg is None:
                    return
                self.agent._guarded(lambda msg=msg: self.agent.handle(msg))
            if not self.paused:
                self.agent._guarded(self.agent.poll)

    def send(self, cmd: str, attempt: int, **fields: Any) -> None:
        self.commands.put({"cmd": cmd, "attempt": attempt, **fields})

    def first(self, event: str, attempt: int, since: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        for t, e in list(self.events):
            if e["event"] == event and e.get("attempt") == attempt and t >= since:
                return t, e
        return None

    def die(self, close_sockets: bool) -> None:
        """Its processes die (the kernel closes its connection to node 0), or its machine vanishes."""
        self.paused = True
        if close_sockets and self.agent.liveness is not None:
            self.agent.liveness.drop()
            self.agent.liveness = None

    def revive(self) -> None:
        self.paused = False


class GpuherdJob:
    def __init__(self, n: int) -> None:
        self.n = n
        self.server, self.port = start_store_server()
        self.requests = Requests()
        made = clients(self.port, 2 * n + 1)  # each node: its main connection and its abort wait's
        conns = [[made.pop(), made.pop()] for _ in range(n)]
        conns[0].append(made.pop())  # node 0: the one its liveness thread names dead nodes on
        self.nodes = [SimNode(r, n, self.port, self.requests, conns[r]) for r in range(n)]

    def join(self, attempt: int, timeout: float) -> float:
        """Every node joins; seconds until the last one has."""
        record = {"host": "sim", "nproc": 8, "fingerprint": "f" * 16, "mode": "script", "run_id": "sim",
                  "run_id_given": True, "run_dir": "/scratch/logs/sim-node0000"}
        started = time.monotonic()
        for node in self.nodes:
            node.send("join", attempt, record={**record, "node": node.r})
        self._until(lambda: all(nd.first("joined", attempt) for nd in self.nodes), timeout, f"join {attempt}")
        for node in self.nodes:
            node.send("watch", attempt)
        return max(nd.first("joined", attempt)[0] for nd in self.nodes) - started

    def steady(self, seconds: float) -> tuple[float, int]:
        """(store requests per node per second, abort events seen) over `seconds` of a running attempt."""
        time.sleep(min(3.0, seconds))  # the first beats and watches settle
        before, aborts_before = self.requests.total(), self._aborts()
        time.sleep(seconds)
        return (self.requests.total() - before) / seconds / self.n, self._aborts() - aborts_before

    def _aborts(self) -> int:
        return sum(1 for nd in self.nodes for _, e in list(nd.events) if e["event"] == "abort")

    def abort_fanout(self, attempt: int, timeout: float = 30.0) -> float:
        """One node publishes a failure: seconds until every node's agent has reported it."""
        cause = {"kind": "worker", "exit_code": 1, "node": self.n - 1, "host": "sim", "rank": 0, "device": None,
                 "stderr_tail": [], "message": f"node {self.n - 1} (sim): CPU0 (rank 0) exit code 1"}
        started = time.monotonic()
        self.nodes[-1].send("abort", attempt, cause=cause)
        self._until(lambda: all(nd.first("abort", attempt) for nd in self.nodes), timeout, "abort fan-out")
        return max(nd.first("abort", attempt)[0] for nd in self.nodes) - started

    def kill(self, attempt: int, victim: int, close_sockets: bool, timeout: float = 40.0) -> tuple[float, bool]:
        """Node `victim` dies; (seconds until every survivor has the abort, whether each names the victim)."""
        killed = time.monotonic()
        self.nodes[victim].die(close_sockets)
        survivors = [nd for nd in self.nodes if nd.r != victim]
        self._until(lambda: all(nd.first("abort", attempt) for nd in survivors), timeout, "node death")
        seen = [nd.first("abort", attempt) for nd in survivors]
        named = all(e["cause"].get("node") == victim and e["cause"].get("kind") == "node" for _, e in seen)
        self.nodes[victim].revive()
        if close_sockets:
            self.nodes[victim].agent._link_to_node0()  # its supervisor restarted: a new connection
        return max(t for t, _ in seen) - killed, named

    def _until(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not done within {timeout:g} s at {self.n} nodes")
            time.sleep(0.01)

    def close(self) -> None:
        for node in self.nodes:
            node.commands.put(None)
        self.server.kill()
        self.server.wait()


def run_gpuherd(n: int, steady_s: float) -> dict[str, Any]:
    job = GpuherdJob(n)
    try:
        out: dict[str, Any] = {"nodes": n, "join_s": job.join(0, JOIN_TIMEOUT_S)}
        out["requests_per_node_s"], out["false_verdicts"] = job.steady(steady_s)
        out["steady_s"] = steady_s
        out["abort_fanout_s"] = job.abort_fanout(0)
        out["rejoin_s"] = job.join(1, JOIN_TIMEOUT_S)
        out["closed_named_s"], out["closed_named_ok"] = job.kill(1, min(3, n - 1), close_sockets=True)
        job.join(2, JOIN_TIMEOUT_S)
        out["vanished_named_s"], out["vanished_named_ok"] = job.kill(2, min(5, n - 1), close_sockets=False)
        out["requests_by_op"] = dict(job.requests.by_op)
        return out
    finally:
        job.close()


# ---------------------------------------------------------------------------- torchrun's c10d
def run_c10d(n: int, steady_s: float, monitor_interval: float = 0.1) -> dict[str, Any]:
    """torch's c10d rendezvous for n simulated nodes: join time and steady store requests."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no second store per round: rank 0 hosts none
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    server, port = start_store_server()
    requests = Requests()
    stop = threading.Event()
    joined: list[float] = []
    handlers = []
    for store in clients(port, n):
        r = len(handlers)
        backend = C10dRendezvousBackend(Counted(store, requests), "sim")
        handlers.append(DynamicRendezvousHandler.from_backend(
            "sim", store, backend, n, n, local_addr=f"node{r}",
            timeout=RendezvousTimeout(join=timedelta(seconds=JOIN_TIMEOUT_S))))

    def node(handler: Any) -> None:
        handler.next_rendezvous()
        joined.append(time.monotonic())
        while not stop.wait(monitor_interval):  # torchrun's agent: _invoke_run's monitor loop
            with contextlib.suppress(Exception):
                handler.num_nodes_waiting()

    started = time.monotonic()
    threads = [threading.Thread(target=node, args=(h,), daemon=True) for h in handlers]
    for t in threads:
        t.start()
    try:
        deadline = started + JOIN_TIMEOUT_S
        while len(joined) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        join_s = max(joined) - started if len(joined) == n else float("nan")
        time.sleep(min(3.0, steady_s))
        before = requests.total()
        time.sleep(steady_s)
        per_node = (requests.total() - before) / steady_s / n
        return {"nodes": n, "join_s": join_s, "requests_per_node_s": per_node, "steady_s": steady_s,
                "requests_by_op": dict(requests.by_op)}
    finally:
        stop.set()
        for h in handlers:
            with contextlib.suppress(Exception):
                h._stop_heartbeats()
        server.kill()
        server.wait()
