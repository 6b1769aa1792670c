"""N simulated nodes on one host: the real node agent's decision code
(supervisor/rendezvous/node_agent_main.py `Agent`), one agent per simulated node with its
own store connections, its own threads and its own protocol state, against one real
`TCPStore` server (libuv) in a process of its own, as node 0's machine serves it.

The nodes are spread over processes (shards of NODES_PER_SHARD), as a cluster gives each
node a CPU of its own: 1,024 agents in one process measured its GIL (thousands of threads
taking turns, each waiting thread waking every 5 ms to ask for it), not the protocol. The
store is the one resource every node shares on a cluster too, and it has a process (one
libuv thread) to itself here as there. Timestamps are the system-wide monotonic clock,
comparable across the shards.

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
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson

from supervisor.rendezvous.node_agent_main import Agent, guarded
from supervisor.validation import LaunchError
from supervisor.validation.limits import ensure_open_files

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
NODES_PER_SHARD = 64  # simulated nodes per process (a shard)
SHARD_START_S = 600.0  # a shard's store connections: about 3 % of torch's client connects take 5 s here
JOIN_TIMEOUT_S = 600.0
STACK = 512 * 1024  # thousands of threads: a small stack each


class Requests:
    """Store calls of every simulated node, by operation, and the bytes their answers brought back."""

    def __init__(self) -> None:
        self.by_op: Counter[str] = Counter()
        self.bytes_by_op: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, op: str, answered: int = 0) -> None:
        with self._lock:
            self.by_op[op] += 1
            self.bytes_by_op[op] += answered

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
            try:
                got = method(*args, **kwargs)
            except BaseException:
                self._requests.add(name)  # a request all the same (a wait that timed out raises)
                raise
            self._requests.add(name, _size(got))
            return got
        return counted


def _size(answer: Any) -> int:
    """The bytes of a store call's answer (a value, or a list of them for `multi_get`)."""
    if isinstance(answer, bytes):
        return len(answer)
    if isinstance(answer, list):
        return sum(len(v) for v in answer if isinstance(v, bytes))
    return 0


CLUSTER_SOFT_FILES = 1024  # the soft open-file limit a cluster's node usually starts a job with


def start_store_server(nodes: int = 0, hard_limit: int | None = None) -> tuple[subprocess.Popen, int]:
    """The job store in a process of its own (its one libuv thread is the store host's CPU),
    started under a cluster's usual soft open-file limit, never raised by the harness: with
    `nodes`, it raises its own limit as node 0's supervisor does for the stores it starts
    (supervisor/validation/limits.py), or ends with that one line when the hard limit (this
    machine's, or `hard_limit`) is too low."""
    code = (f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\nfrom datetime import timedelta\n"
            "from supervisor.validation import LaunchError\nfrom supervisor.validation.limits import ensure_open_files\n"
            f"try:\n    ensure_open_files(1, hosted_nodes={nodes})\n"
            "except LaunchError as exc:\n    sys.exit(str(exc))\nfrom torch.distributed import TCPStore\n"
            "s = TCPStore('127.0.0.1', 0, None, True, timedelta(seconds=600), wait_for_workers=False)\n"
            "print(s.port, flush=True)\nsys.stdin.read()\n")
    errors = tempfile.TemporaryFile()  # not a pipe: a store that logs a lot must never block on it
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=errors, preexec_fn=lambda: cluster_limit(hard_limit))
    line = proc.stdout.readline()
    if not line:  # its stdout closed as it exits: reaped before it is named, never left behind
        proc.communicate(timeout=30)
        errors.seek(0)
        raise RuntimeError(f"the job store did not start: {errors.read().decode(errors='replace')[-1000:].strip()}")
    return proc, int(line)


def cluster_limit(hard_limit: int | None = None) -> None:
    """A child's soft open-file limit as a cluster's node starts a job: CLUSTER_SOFT_FILES (the
    hard limit stays this machine's, or `hard_limit`), whatever this process was given."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard_limit is None else hard_limit
    soft = CLUSTER_SOFT_FILES if hard == resource.RLIM_INFINITY else min(CLUSTER_SOFT_FILES, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def client(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(HOST, port, None, False, timedelta(seconds=JOIN_TIMEOUT_S))


def clients(port: int, count: int) -> list[Any]:
    """`count` store clients, made by many threads at once: about 3 % of torch's client connects
    take 5 s here (one at a time or not), so thousands made in turn would take minutes."""
    with ThreadPoolExecutor(max_workers=256) as pool:
        return list(pool.map(lambda _: client(port), range(count)))


def roomy(hosted_nodes: int) -> None:
    """Hundreds of sockets and threads in one process, under the cluster's soft open-file limit
    (cluster_limit): a shard of NODES_PER_SHARD nodes holds about 3 sockets a node, well under
    it, and is never raised by the harness. The shard of node 0 (`hosted_nodes`: N, else 0) holds
    node 0's agent, whose liveness server holds a socket per node: it raises its limit as node
    0's supervisor does before the join for the agent it starts (the agent inherits it), or ends
    with that supervisor's one-line refusal."""
    ensure_open_files(1, hosted_nodes=hosted_nodes)
    threading.stack_size(STACK)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


# ---------------------------------------------------------------------------- gpuherd
class _Events:
    """What one node's agent answered, each with the (system-wide monotonic) time it did."""

    r: int
    events: list[tuple[float, dict[str, Any]]]

    def first(self, event: str, attempt: int, since: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        for t, e in list(self.events):
            if e["event"] == event and e.get("attempt") == attempt and t >= since:
                return t, e
        return None


class SimNode(_Events):
    """One simulated node: its agent, driven like its supervisor drives it, in a thread of its own."""

    def __init__(self, r: int, n: int, port: int, requests: Requests, conns: list[Any],
                 forward: Any = None) -> None:
        """`conns`: this node's store connections, made beforehand (the first is its main one);
        `forward(r, t, event)`: where each event goes too (its shard's pipe to the harness)."""
        self.r = r
        self.agent = Agent(Counted(conns.pop(), requests), r, n, JOIN_TIMEOUT_S, f"{HOST}:{port}")
        self.agent.connect = lambda: Counted(conns.pop() if conns else client(port), requests)
        self.agent.emit = self._on_event
        self.events = []
        self.forward = forward
        self.commands: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self.paused = False  # a dead node: no beat, no command
        if r == 0:
            self.agent.serve_liveness(HOST)
        self.thread = threading.Thread(target=self._serve, name=f"node{r}", daemon=True)
        self.thread.start()

    def _on_event(self, event: str, **fields: Any) -> None:
        if "nodes" in fields and isinstance(fields["nodes"], list):
            # Its supervisor parses the N join records in a process of its own; here a shard's
            # nodes would keep N records each (gigabytes at 1,024) in one heap.
            fields["nodes"] = len(fields["nodes"])
        if not self.paused:
            t, e = time.monotonic(), {"event": event, **fields}
            self.events.append((t, e))
            if self.forward is not None:
                self.forward(self.r, t, e)

    def _serve(self) -> None:
        """The agent's own loop (`Agent.serve`), commands from a queue instead of stdin."""
        while True:
            try:
                msg = self.commands.get(timeout=max(0.01, self.agent.next_beat - time.monotonic()))
            except queue.Empty:
                msg = None
            else:
                if msg is None:
                    return
                guarded(self.agent, lambda msg=msg: self.agent.handle(msg))
            if not self.paused:
                guarded(self.agent, self.agent.poll)

    def send(self, cmd: str, attempt: int, **fields: Any) -> None:
        self.commands.put({"cmd": cmd, "attempt": attempt, **fields})

    def die(self, close_sockets: bool) -> None:
        """Its processes die (the kernel closes its connection to node 0), or its machine vanishes."""
        self.paused = True
        if close_sockets and self.agent.liveness is not None:
            self.agent.liveness.drop()
            self.agent.liveness = None

    def revive(self, relink: bool) -> None:
        self.paused = False
        if relink:
            self.agent._link_to_node0()  # its supervisor restarted: a new connection


def shard_main(argv: list[str]) -> int:
    """One shard: simulated nodes FIRST..LAST-1 of N, driven by JSON lines on stdin, their
    events as JSON lines on stdout.  python -m bench.scale_sim PORT N FIRST LAST"""
    port, n, first, last = (int(a) for a in argv)
    try:
        roomy(n if first == 0 else 0)
    except LaunchError as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    requests = Requests()
    made = clients(port, 2 * (last - first) + (first == 0))  # each node: its main connection and its abort wait's
    conns = {r: [made.pop(), made.pop()] for r in range(first, last)}
    if first == 0:
        conns[0].append(made.pop())  # node 0: the one its liveness thread names dead nodes on
    out = sys.stdout.buffer
    writing = threading.Lock()

    def say(msg: dict[str, Any]) -> None:
        with writing:
            out.write(orjson.dumps(msg) + b"\n")
            out.flush()

    nodes = {r: SimNode(r, n, port, requests, conns[r], lambda r, t, e: say({"node": r, "t": t, "event": e}))
             for r in range(first, last)}
    say({"ready": True})
    for line in sys.stdin.buffer:
        msg = orjson.loads(line)
        targets = [nodes[msg["node"]]] if "node" in msg else list(nodes.values())
        if "cmd" in msg:
            for node in targets:
                node.commands.put(msg["cmd"])
        elif "die" in msg:
            targets[0].die(msg["die"])
        elif "revive" in msg:
            targets[0].revive(msg["revive"])
        elif "requests" in msg:
            say({"requests": dict(requests.by_op), "bytes": dict(requests.bytes_by_op)})
    os._exit(0)  # the agents' threads block in the store: no interpreter teardown waits for them


class Shard:
    """A process of `NODES_PER_SHARD` simulated nodes, as a cluster gives each node its own CPU:
    one process of 1,024 nodes spends its time handing one GIL to thousands of threads, which
    measures Python, not the protocol."""

    def __init__(self, port: int, n: int, first: int, last: int) -> None:
        self.nodes = {r: RemoteNode(r, self) for r in range(first, last)}
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.errors = tempfile.TemporaryFile()  # not a pipe: torch's chatter must never block a shard
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.scale_sim", str(port), str(n), str(first),
                                      str(last)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.errors, cwd=ROOT, env=env, preexec_fn=cluster_limit)
        self.ready = threading.Event()
        self._counts: queue.SimpleQueue[tuple[dict[str, int], dict[str, int]]] = queue.SimpleQueue()
        self._writing = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def started(self, timeout: float) -> None:
        """Its nodes are up; else a RuntimeError with what the shard said (node 0's refusal)."""
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.errors.seek(0)
                said = self.errors.read().decode(errors="replace").strip()[-1000:]
                raise RuntimeError(f"a shard of simulated nodes did not start: {said or 'no output'}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = orjson.loads(line)
            if "node" in msg:
                self.nodes[msg["node"]].events.append((msg["t"], msg["event"]))
            elif "requests" in msg:
                self._counts.put((msg["requests"], msg["bytes"]))
            elif "ready" in msg:
                self.ready.set()

    def put(self, msg: dict[str, Any]) -> None:
        with self._writing:
            self.proc.stdin.write(orjson.dumps(msg) + b"\n")
            self.proc.stdin.flush()

    def requests(self) -> tuple[dict[str, int], dict[str, int]]:
        """(store calls of its nodes so far by operation, the bytes their answers brought back)."""
        self.put({"requests": True})
        return self._counts.get(timeout=60)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RemoteNode(_Events):
    """A simulated node in a shard, as the harness drives and watches it."""

    def __init__(self, r: int, shard: Shard) -> None:
        self.r, self.shard = r, shard
        self.events = []

    def send(self, cmd: str, attempt: int, **fields: Any) -> None:
        self.shard.put({"node": self.r, "cmd": {"cmd": cmd, "attempt": attempt, **fields}})

    def die(self, close_sockets: bool) -> None:
        self.shard.put({"node": self.r, "die": close_sockets})

    def revive(self, relink: bool) -> None:
        self.shard.put({"node": self.r, "revive": relink})


class GpuherdJob:
    def __init__(self, n: int, per_shard: int = NODES_PER_SHARD) -> None:
        self.n = n
        self.server, self.port = start_store_server(n)
        self.shards = [Shard(self.port, n, first, min(n, first + per_shard)) for first in range(0, n, per_shard)]
        try:
            for shard in self.shards:
                shard.started(SHARD_START_S)
        except RuntimeError:
            self.close()
            raise
        self.nodes = [node for shard in self.shards for node in shard.nodes.values()]

    def requests(self) -> Counter[str]:
        """Store calls of every simulated node so far, by operation."""
        return self.traffic()[0]

    def traffic(self) -> tuple[Counter[str], Counter[str]]:
        """(store calls of every simulated node so far by operation, the bytes their answers brought back)."""
        calls: Counter[str] = Counter()
        answered: Counter[str] = Counter()
        for shard in self.shards:
            by_op, bytes_by_op = shard.requests()
            calls.update(by_op)
            answered.update(bytes_by_op)
        return calls, answered

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
        before, aborts_before = sum(self.requests().values()), self._aborts()
        time.sleep(seconds)
        return (sum(self.requests().values()) - before) / seconds / self.n, self._aborts() - aborts_before

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

    def verdict_fanout(self, attempt: int, timeout: float = 60.0) -> dict[str, Any]:
        """An ordinary worker failure: every node asks its agent which nodes are dead (`alive`, as
        each node's supervisor does settling the failed attempt) at once, nobody dead. Seconds
        until every node has its answer, the verdict reads (`get`: no other get runs meanwhile)
        and the bytes they brought back per node, the store requests they took (each read a `get`,
        its `check` too until the key was seen), and the answers that named a node (false)."""
        before, bytes_before = self.traffic()
        started = time.monotonic()
        for node in self.nodes:
            node.send("alive", attempt)
        self._until(lambda: all(nd.first("alive", attempt, started) for nd in self.nodes), timeout, "alive checks")
        after, bytes_after = self.traffic()
        answers = [nd.first("alive", attempt, started) for nd in self.nodes]
        return {"verdict_s": max(t for t, _ in answers) - started,
                "verdict_reads_per_node": (after["get"] - before["get"]) / self.n,
                "verdict_requests_per_node": (after["get"] + after["check"] - before["get"] - before["check"]) / self.n,
                "verdict_bytes_per_node": (bytes_after["get"] - bytes_before["get"]) / self.n,
                "verdict_false": sum(1 for _, e in answers if e["silent"])}

    def kill(self, attempt: int, victim: int, close_sockets: bool, timeout: float = 40.0) -> tuple[float, bool]:
        """Node `victim` dies; (seconds until every survivor has the abort, whether each names the victim)."""
        killed = time.monotonic()
        self.nodes[victim].die(close_sockets)
        survivors = [nd for nd in self.nodes if nd.r != victim]
        self._until(lambda: all(nd.first("abort", attempt) for nd in survivors), timeout, "node death")
        seen = [nd.first("abort", attempt) for nd in survivors]
        named = all(e["cause"].get("node") == victim and e["cause"].get("kind") == "node" for _, e in seen)
        self.nodes[victim].revive(relink=close_sockets)  # its supervisor restarted: a new connection
        return max(t for t, _ in seen) - killed, named

    def _until(self, done: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not done within {timeout:g} s at {self.n} nodes")
            time.sleep(0.01)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
        self.server.kill()
        self.server.wait()


def run_gpuherd(n: int, steady_s: float) -> dict[str, Any]:
    job = GpuherdJob(n)
    try:
        out: dict[str, Any] = {"nodes": n, "shards": len(job.shards), "join_s": job.join(0, JOIN_TIMEOUT_S)}
        out["requests_per_node_s"], out["false_verdicts"] = job.steady(steady_s)
        out["steady_s"] = steady_s
        out["abort_fanout_s"] = job.abort_fanout(0)
        out.update(job.verdict_fanout(0))
        out["rejoin_s"] = job.join(1, JOIN_TIMEOUT_S)
        out["closed_named_s"], out["closed_named_ok"] = job.kill(1, min(3, n - 1), close_sockets=True)
        job.join(2, JOIN_TIMEOUT_S)
        out["vanished_named_s"], out["vanished_named_ok"] = job.kill(2, min(5, n - 1), close_sockets=False)
        out["requests_by_op"] = dict(job.requests())
        return out
    finally:
        job.close()


# ---------------------------------------------------------------------------- torchrun's c10d
def run_c10d(n: int, steady_s: float, monitor_interval: float = 0.1) -> dict[str, Any]:
    """torch's c10d rendezvous for n simulated nodes: join time and steady store requests."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # no second store per round: rank 0 hosts none
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout

    server, port = start_store_server()  # torchrun raises no limit: its store keeps the cluster's soft one
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


if __name__ == "__main__":
    raise SystemExit(shard_main(sys.argv[1:]))
