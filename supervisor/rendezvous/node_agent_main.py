"""One node's link to the job store, in a helper process (multi-node runs only).

The supervisor stays torch-free; this process imports torch for its `TCPStore`,
which node 0 hosts on `--master-addr:--master-port` (from a socket the supervisor
bound, so a busy port fails before anything starts) and every node's agent uses as
a client. Keys, per attempt k:

    a{k}/node{r}   node r's join record (JSON: host, nproc, config hash, ...)
    a{k}/abort     the job's root cause: the first failure any node publishes
                   (compare_set: first writer wins, everyone reads the same one)
    a{k}/done{r}   node r's workers all finished
    a{k}/beat{r}   node r's heartbeat counter (set by node r, compared as bytes by the others) from attempt k on (until it leaves or joins
                   attempt k+1); one that stands still for SILENT_S (and is not done) makes
                   the watching agent publish "node r stopped responding" as the abort
    left{r}        node r is done with the store (node 0 keeps it up until then)
    outcome{r}     node r's outcome at the end of the job (exit code, final save, run dir), for
                   the one summary node 0 prints

With --nnodes MIN:MAX (elastic) node 0 also decides who is in each round (elastic_rounds.py:
`round`, `a{k}/members`, `closed`); a late node's `join` first answers `waiting {round,
members}` and then joins the next round; node 0 restarts the job for it (an abort of kind
`membership`), and `joined` carries the round actually joined.

Every value read back is checked: one that no node of this job writes (the store has no
authentication, as under torchrun) becomes a root cause naming the key, never a crash.

Protocol with the supervisor: one JSON object per line; commands on stdin,
events on stdout (stderr is torch's own chatter, kept in the run's agent log).

    {"cmd": "join", "attempt": k, "record": {...}}   -> [waiting {round, members}] joined {round, members, nodes}
                                                        | join-timeout {missing} | join-closed
                                                        | abort {cause} then join-aborted
    {"cmd": "watch", "attempt": k}                   -> abort {cause} when any node publishes one
    {"cmd": "abort", "attempt": k, "cause": {...}}   -> abort {cause: the winner}
    {"cmd": "done", "attempt": k}
    {"cmd": "wait-done", "attempt": k, "timeout": s} -> [abort {cause}] then finished {missing: nodes not done}
    {"cmd": "alive", "attempt": k}                   -> alive {silent: [cause, ...]} within SILENT_S + 2 s:
                                                        after a failure, the nodes that stopped beating (a
                                                        worker's "connection closed by peer" is then their
                                                        consequence, not the job's cause)
    {"cmd": "outcome", "outcome": {...}}             (a node other than 0: how it ended)
    {"cmd": "outcomes", "timeout": s}                -> outcomes {nodes: [outcome or null for nodes 1..]}
    {"cmd": "leave"}                                 (a node other than 0 is done with the store)
    {"cmd": "linger", "timeout": s}                  -> lingered {missing}: node 0 waited for every leave
    (always possible)                                -> lost {message}: the store is gone

    python -m supervisor.rendezvous.node_agent_main NODE_RANK MIN_NODES:NNODES HOST PORT JOIN_TIMEOUT_S
        LAST_CALL_S [LISTEN_FD]
"""

from __future__ import annotations

import os
import selectors
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import orjson

from gpuherd.exit_codes import ExitCode
from supervisor.rendezvous.elastic_rounds import ElasticRounds, refused_key
from supervisor.rendezvous.nodes import settings_problem

POLL_S = 0.05  # abort latency is at most this plus one store round trip
BEAT_S = 1.0  # each agent bumps its node's counter this often while an attempt runs
SILENT_S = 10.0  # a node whose counter stood still this long is gone (machine, or its supervisor, died)


class TimedStore:
    """A client's store whose calls say when the one in flight began: a call node 0 never
    answers (a network partition sends no RST, so the TCP connection just waits) is seen
    by the watchdog thread while the call still blocks."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.waiting_since: float | None = None

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def timed(*args: Any) -> Any:
            self.waiting_since = time.monotonic()
            try:
                return method(*args)
            finally:
                self.waiting_since = None
        return timed


class Agent:
    def __init__(self, store: Any, node_rank: int, nnodes: int, join_timeout: float, where: str,
                 rounds: ElasticRounds | None = None) -> None:
        """`rounds`: an elastic job's (--nnodes MIN:MAX, `nnodes` is MAX); None: a fixed size."""
        self.store, self.node_rank, self.nnodes = store, node_rank, nnodes
        self.rounds = rounds
        self.members = list(range(nnodes))  # the nodes in the round being run
        self.join_timeout, self.where = join_timeout, where
        self.watching: int | None = None
        self.beating: int | None = None  # the attempt whose beat counter this agent bumps
        self.verifying: tuple[int, float] | None = None  # an "alive" check: (attempt, when it began)
        self.last_join: int | None = None
        self.lost = False
        self.hosts: dict[int, str] = {}
        self.gone: set[int] = set()  # nodes found silent: nobody waits for them to leave
        self._next_beat = 0.0
        self._beats: dict[int, tuple[bytes | None, float]] = {}  # node -> (last counter seen, when it changed)
        self._beat_count = 0
        self._emitting = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        with self._emitting:  # the loop and the store watchdog
            sys.stdout.buffer.write(orjson.dumps({"event": event, **fields}) + b"\n")
            sys.stdout.buffer.flush()

    def watch_store(self) -> None:
        """A node other than 0: a store call unanswered for SILENT_S means node 0 (its machine,
        or the network to it) is gone; this node names it within ~SILENT_S, as node 0 names a
        node whose heartbeat stopped, instead of waiting out the join timeout. The blocked call
        keeps the loop, so the verdict ends the agent too."""
        while True:
            time.sleep(BEAT_S)
            since = self.store.waiting_since
            if since is not None and time.monotonic() - since > SILENT_S and not self.lost:
                self.lost = True
                self.emit("lost", message=f"lost the job store at {self.where} (node 0 gone?): no answer for "
                                          f"{SILENT_S:.0f} s (node 0's machine, or the network to it)")
                os._exit(1)

    def _missing(self, keys: list[str]) -> list[int]:
        return [i for i, key in enumerate(keys) if not self.store.check([key])]

    def _wait_keys(self, keys: list[str], timeout: float, abort_key: str | None = None) -> list[int] | dict:
        """[] when every key exists, the abort cause (a dict) if one appears first, else the missing indexes."""
        deadline = time.monotonic() + timeout
        while True:
            if abort_key is not None and self.store.check([abort_key]):
                return self._cause(abort_key, self.store.get(abort_key))
            missing = self._missing(keys)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)

    def _joined(self, k: int, keys: list[str], members: list[int] | None = None) -> None:
        """Every node's join record, each checked: a value no gpuherd node writes is named (key, and
        the node whose key it is) as the job's cause instead of crashing this agent."""
        members = list(range(len(keys))) if members is None else members
        nodes = []
        for i, key in zip(members, keys, strict=True):
            raw = self.store.get(key)
            record = _json_or_none(raw)
            if not (isinstance(record, dict) and isinstance(record.get("nproc"), int) and record["nproc"] > 0):
                cause = self._malformed(key, raw, f"node {i}'s join record (host, nproc, settings)")
                winner = self.store.compare_set(f"a{k}/abort", "", orjson.dumps(cause))
                self.emit("abort", attempt=k, cause=self._cause(f"a{k}/abort", winner))
                self.emit("join-aborted", attempt=k)
                return
            nodes.append(record)
        self.hosts = {i: str(n.get("host", "?")) for i, n in zip(members, nodes, strict=True)}
        self.members = members
        self.emit("joined", attempt=k, round=k, members=members, nodes=nodes)

    def _cause(self, key: str, raw: bytes) -> dict[str, Any]:
        """A root cause read from the store; a value that is not one becomes a cause naming it."""
        cause = _json_or_none(raw)
        if isinstance(cause, dict) and isinstance(cause.get("message"), str) and isinstance(cause.get("kind"), str) \
                and isinstance(cause.get("exit_code"), int):
            return cause
        return self._malformed(key, raw, "a root cause, written by the node that failed first")

    def _malformed(self, key: str, raw: bytes, expected: str) -> dict[str, Any]:
        shown = raw[:80].decode("utf-8", "backslashreplace") + ("..." if len(raw) > 80 else "")
        return {"kind": "store", "exit_code": 1, "node": None, "host": None, "rank": None, "device": None,
                "stderr_tail": [],
                "message": f"malformed data on the job store at {self.where}: key {key} holds {shown!r}, not "
                           f"{expected}; no gpuherd node of this job wrote it (another program reached the store: "
                           "it has no authentication, as under torchrun)"}

    def handle(self, msg: dict[str, Any]) -> None:
        k, cmd = int(msg.get("attempt", -1)), msg["cmd"]
        if cmd == "join" and not self._claim_rank(k, msg["record"]):
            return
        if cmd == "join" and self.rounds is not None:
            self._join_elastic(orjson.dumps(msg["record"]))
        elif cmd == "join":
            self.last_join = k
            self.store.set(f"a{k}/node{self.node_rank}", orjson.dumps(msg["record"]))
            keys = [f"a{k}/node{i}" for i in range(self.nnodes)]
            missing = self._wait_keys(keys, self.join_timeout, abort_key=f"a{k}/abort")
            if isinstance(missing, dict):  # a node failed before it could join (its dataset, say)
                self.emit("abort", attempt=k, cause=missing)
                self.emit("join-aborted", attempt=k)
            elif missing:
                self.emit("join-timeout", attempt=k, missing=missing, timeout=self.join_timeout)
            else:
                self._joined(k, keys)
        elif cmd == "watch":
            self.watching = self.beating = k
            self._beats = {}
        elif cmd == "alive":
            began = time.monotonic()
            self._last_beats(k, began)  # the baseline: a node first seen now must move to count as alive
            self.verifying = (k, began)
        elif cmd == "abort":
            payload = orjson.dumps(msg["cause"])
            winner = self.store.compare_set(f"a{k}/abort", "", payload)  # first writer wins
            self.emit("abort", attempt=k, cause=self._cause(f"a{k}/abort", winner))
            self.watching = None  # reported
        elif cmd == "done":
            self.store.set(f"a{k}/done{self.node_rank}", b"1")
        elif cmd == "wait-done":
            result = self._wait_keys([f"a{k}/done{i}" for i in self.members], float(msg["timeout"]),
                                     abort_key=f"a{k}/abort")
            if isinstance(result, dict):
                self.emit("abort", attempt=k, cause=result)
            self.emit("finished", attempt=k, missing=[] if isinstance(result, dict) else result)
        elif cmd == "outcome":
            self.store.set(f"outcome{self.node_rank}", orjson.dumps(msg["outcome"]))
        elif cmd == "outcomes":  # node 0: the others' (a node found silent is not waited for)
            others = [i for i in self.members if i != 0]  # elastic: the last round's nodes, not every rank up to MAX
            self._wait_keys([f"outcome{i}" for i in others if i not in self.gone], float(msg["timeout"]))
            found = [_json_or_none(self.store.get(f"outcome{i}")) if self.store.check([f"outcome{i}"]) else None
                     for i in others]
            self.emit("outcomes", ranks=others, nodes=[o if isinstance(o, dict) else None for o in found])
        elif cmd == "leave":
            self.beating = None
            self.store.set(f"left{self.node_rank}", b"1")
        elif cmd == "linger":  # node 0: the store stays up until every node that joined has read what it needs
            if self.rounds is not None:
                self.rounds.close_job()  # a node still waiting to be admitted stops waiting
            last = 0 if self.last_join is None else self.last_join  # node 0 may fail before its own join
            joined = [i for i in range(1, self.nnodes) if i not in self.gone and self.store.check([f"a{last}/node{i}"])]
            missing = self._wait_keys([f"left{i}" for i in joined], float(msg["timeout"]))
            self.emit("lingered", missing=[joined[i] for i in missing])

    def _join_elastic(self, record: bytes) -> None:
        """Join the next round of an elastic job (elastic_rounds.py): node 0 decides who is in."""
        rounds = self.rounds
        aborted = lambda k: self.store.check([f"a{k}/abort"])  # noqa: E731 - a node failed before joining
        if self.node_rank == 0:
            k, members = rounds.open_and_close(record, aborted)
            if members is None and not aborted(k):  # fewer than MIN in time: every waiting node reads why
                too_few = rounds.too_few(k, lambda r: self._record_host(k, r), self.where)
                self.store.compare_set(f"a{k}/abort", "", orjson.dumps(too_few))
        else:
            target = self._wait_round()
            if target is None:
                self.emit("join-timeout", attempt=0, missing=[0], timeout=self.join_timeout)
                return
            k, late = target
            if late:  # round k-1 runs without this node
                self._say_waiting(k - 1, rounds.members_of(k - 1) or [])
            k, members, why = rounds.admitted(k, record, aborted, self._say_waiting)
            if why == "closed":
                self.emit("join-closed", attempt=k)
                return
            if why == "refused":  # node 0 found this node's settings differ from the job's
                self.emit("abort", attempt=k, cause=self._cause(refused_key(self.node_rank),
                                                                self.store.get(refused_key(self.node_rank))))
                self.emit("join-aborted", attempt=k)
                return
        self.last_join = k
        if members is None:
            self.emit("abort", attempt=k, cause=self._cause(f"a{k}/abort", self.store.get(f"a{k}/abort")))
            self.emit("join-aborted", attempt=k)
        else:
            self._joined(k, [f"a{k}/node{r}" for r in members], members)

    def _wait_round(self) -> tuple[int, bool] | None:
        """A node other than 0: the round to join once node 0 opened one (None: not within the join timeout)."""
        deadline = time.monotonic() + self.join_timeout
        while (target := self.rounds.target()) is None:
            if self.store.check(["a0/abort"]):  # node 0 failed before it could open a round (its dataset)
                return 0, False
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
        return target

    def _say_waiting(self, k: int, members: list[int]) -> None:
        self.emit("waiting", attempt=k, round=k, members=members)

    def _record_host(self, k: int, r: int) -> str:
        record = _json_or_none(self.store.get(f"a{k}/node{r}"))
        return str(record.get("host", "?")) if isinstance(record, dict) else "?"

    def _admit_waiting(self, k: int) -> None:
        """Node 0 of an elastic job, while round k runs: a node waiting for the next round restarts
        every node's workers so it joins (torchrun's num_nodes_waiting > 0)."""
        waiting = [r for r in self.rounds.waiting(k) if self._settings_agree(k, r)]
        if not waiting:
            return
        who = ", ".join(f"node {r} ({self._record_host(k + 1, r)})" for r in waiting)
        cause = {"kind": "membership", "exit_code": 0, "node": None, "host": None, "rank": None, "device": None,
                 "stderr_tail": [],
                 "message": f"{who} asked to join: restarting every node's workers to admit it (a membership "
                            "change, not counted against --max-restarts)"}
        self.store.compare_set(f"a{k}/abort", "", orjson.dumps(cause))

    def _claim_rank(self, k: int, record: dict[str, Any]) -> bool:
        """The first agent to join as node r owns that --node-rank for the whole job (its later
        attempts too); another node started with the same one is refused alone, exit 2, before its
        record could overwrite the owner's."""
        mine = f"{record.get('host', '?')} (agent pid {os.getpid()})".encode()
        owner = self.store.compare_set(f"rank{self.node_rank}/owner", "", mine)
        if owner == mine:
            return True
        shown = owner.decode("utf-8", "backslashreplace")[:120]
        cause = {"kind": "rendezvous", "exit_code": int(ExitCode.USAGE), "node": self.node_rank,
                 "host": record.get("host"), "rank": None, "device": None, "stderr_tail": [],
                 "message": f"--node-rank {self.node_rank} is already taken in this job, by {shown}: give each "
                            "node its own --node-rank (0..N-1)"}
        self.emit("abort", attempt=k, cause=cause)
        self.emit("join-aborted", attempt=k)
        return False

    def _settings_agree(self, k: int, r: int) -> bool:
        """Node 0: a waiting node with another --run-id, model or mode would take the healthy job
        down at its admission (every node exits 2 then): it is refused alone, before that."""
        mine, theirs = (_json_or_none(self.store.get(key)) for key in (f"a{k}/node0", f"a{k + 1}/node{r}"))
        if not (isinstance(mine, dict) and isinstance(theirs, dict)):
            return True  # a malformed record is named at the join itself
        problem = settings_problem(theirs, mine, r)
        if problem is None:
            return True
        cause = {"kind": "rendezvous", "exit_code": int(ExitCode.USAGE), "node": r, "host": theirs.get("host"),
                 "rank": None, "device": None, "stderr_tail": [],
                 "message": f"{problem}; it was not admitted, the job goes on without it"}
        self.rounds.refuse(k, r, orjson.dumps(cause))
        return False

    def poll(self) -> None:
        if self.watching is not None and self.store.check([f"a{self.watching}/abort"]):
            k, self.watching = self.watching, None
            cause = self._cause(f"a{k}/abort", self.store.get(f"a{k}/abort"))
            if cause.get("kind") == "node" and isinstance(cause.get("node"), int):
                self.gone.add(cause["node"])  # another agent found it silent
            self.emit("abort", attempt=k, cause=cause)
            return
        now = time.monotonic()
        if now < self._next_beat or (self.beating is None and self.verifying is None):
            return
        self._next_beat = now + BEAT_S
        if self.beating is not None:  # set, not add: a foreign value in the key cannot break our connection
            self._beat_count += 1
            self.store.set(f"a{self.beating}/beat{self.node_rank}", str(self._beat_count).encode())
        if self.watching is not None:
            self._check_beats(self.watching, now)
            if self.rounds is not None and self.node_rank == 0 and self.watching is not None:
                self._admit_waiting(self.watching)
        elif self.verifying is not None:
            self._verify_alive(now)

    def _last_beats(self, k: int, now: float) -> dict[int, float]:
        """When each other node's counter last moved, for the nodes still expected to beat
        (not done, not gone, not left, not yet in attempt k+1)."""
        out = {}
        for r in self.members:
            if r == self.node_rank or r in self.gone:
                continue
            if any(self.store.check([key]) for key in (f"a{k}/done{r}", f"left{r}", f"a{k + 1}/node{r}")):
                continue
            key = f"a{k}/beat{r}"
            count = self.store.get(key) if self.store.check([key]) else None  # bytes: compared, never parsed
            last, since = self._beats.get(r, (None, now))
            if count != last:
                self._beats[r] = (count, now)
                since = now
            out[r] = since
        return out

    def _silent(self, r: int, silent_s: float) -> dict[str, Any]:
        host = self.hosts.get(r, "?")
        self.gone.add(r)
        return {"kind": "node", "exit_code": 1, "node": r, "host": host, "rank": None, "device": None,
                "stderr_tail": [],
                "message": f"node {r} ({host}) stopped responding: no heartbeat for {silent_s:.0f} s "
                           "(its machine, its supervisor or its node agent died; see that node's logs)"}

    def _check_beats(self, k: int, now: float) -> None:
        for r, since in self._last_beats(k, now).items():
            if now - since > SILENT_S:
                self.handle({"cmd": "abort", "attempt": k, "cause": self._silent(r, now - since)})
                return

    def _verify_alive(self, now: float) -> None:
        """A node whose counter moved since the check began is alive; one still for SILENT_S is
        not. Undecided ones are waited for, at most SILENT_S + 2 s (then counted alive)."""
        k, began = self.verifying
        last = self._last_beats(k, now)
        undecided = [r for r, since in last.items() if since <= began and now - since <= SILENT_S]
        if undecided and now - began < SILENT_S + 2:
            return
        silent = [self._silent(r, now - since) for r, since in last.items() if since <= began and now - since > SILENT_S]
        self.verifying = None
        self.emit("alive", attempt=k, silent=silent)

    def serve(self) -> None:
        sel = selectors.DefaultSelector()
        stdin = sys.stdin.buffer
        os.set_blocking(stdin.fileno(), False)
        sel.register(stdin.fileno(), selectors.EVENT_READ)
        pending = b""
        while True:
            if sel.select(POLL_S):
                chunk = os.read(stdin.fileno(), 1 << 16)
                if not chunk:
                    return  # the supervisor is gone or done with us
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._guarded(lambda line=line: self.handle(orjson.loads(line)))
            self._guarded(self.poll)

    def _guarded(self, action: Any) -> None:
        if self.lost:
            return
        try:
            action()
        except RuntimeError as exc:  # torch's DistError family: the store (node 0) is unreachable
            self.lost = True
            detail = " ".join(str(exc).split())[:200]
            self.emit("lost", message=f"lost the job store at {self.where} (node 0 gone?): {detail}")


def _json_or_none(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def main(argv: list[str]) -> int:
    node_rank, host, port, join_timeout = int(argv[0]), argv[2], int(argv[3]), float(argv[4])
    min_nodes, nnodes = (int(n) for n in argv[1].split(":"))
    last_call = float(argv[5])
    listen_fd = int(argv[6]) if len(argv) > 6 else None
    where = f"{host}:{port}"
    from torch.distributed import TCPStore

    try:
        if node_rank == 0:
            store = TCPStore(host, port, None, True, timedelta(seconds=join_timeout), wait_for_workers=False,
                             master_listen_fd=listen_fd)
        else:
            store = TimedStore(TCPStore(host, port, None, False, timedelta(seconds=join_timeout)))
    except RuntimeError as exc:
        detail = " ".join(str(exc).split("Exception raised from")[0].split())[:200]
        sys.stdout.buffer.write(orjson.dumps({"event": "join-timeout", "attempt": 0, "missing": [0],
                                              "timeout": join_timeout, "unreachable": True,
                                              "detail": detail}) + b"\n")
        sys.stdout.buffer.flush()
        return 5
    rounds = None
    if min_nodes < nnodes:
        rounds = ElasticRounds(store, node_rank, min_nodes, nnodes, join_timeout, last_call)
    agent = Agent(store, node_rank, nnodes, join_timeout, where, rounds)
    if isinstance(store, TimedStore):
        threading.Thread(target=agent.watch_store, name="store-watchdog", daemon=True).start()
    agent.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
