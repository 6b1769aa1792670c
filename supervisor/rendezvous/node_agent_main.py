"""One node's link to the job store, in a helper process (multi-node runs only).

The supervisor stays torch-free; this process imports torch for its `TCPStore`,
which node 0 hosts on `--master-addr:--master-port` (from a socket the supervisor
bound, so a busy port fails before anything starts) and every node's agent uses as
a client. Keys, per attempt k (names in beat_watch.py):

    a{k}/node{r}   node r's join record (JSON: host, nproc, config hash, ...)
    a{k}/nodes     every node's join record in one value (a JSON list), written by node 0 once every
                   record is in: each node then reads one key, not N
    a{k}/all       the join is decided: "in" (set by node 0, after a{k}/nodes)
                   or "abort"
    a{k}/abort     the job's root cause: the first failure any node publishes
                   (compare_set: first writer wins, everyone reads the same one)
    a{k}/done{r}   node r's workers all finished
    a{k}/beat{r}   node r's heartbeat counter, set by node r every BEAT_S from its join until it
                   leaves ("left"), finishes ("done") or joins attempt k+1 ("moved"); node 0
                   alone reads them all (one multi_get per BEAT_S) and publishes "node r stopped
                   responding" as the abort when one stands still for SILENT_S (system.node_silence_timeout);
                   every CHECK_BEAT_S instead (the beat, node 0's reading) while the node has
                   an `alive` check pending
    a{k}/verdict   node 0's latest reading of the beats, a few dozen bytes however many nodes
                   (verdict.py): {seq, floor, late: {r: seq it last moved}, dead: [causes]}, for
                   an `alive` check on any node
    left{r}        node r is done with the store (node 0 keeps it up until then)
    outcome{r}     node r's outcome at the end of the job (exit code, final save, run dir), for
                   the one summary node 0 prints
    liveness       node 0's "host:port" for the agents' direct connections (liveness.py): one that
                   ends without a goodbye names its node at once, before any silence
    rank{r}/owner  the agent holding --node-rank r; freed by node 0 once it is found dead, for the node
                   started again in its place (rank_claims.py)
    joining        node 0's latest join (fixed size): where a node started again joins

No loop asks the store about N keys: joins, the done wait and the linger are server-side
waits (`TCPStore.wait`), each node blocks on the abort key in a thread of its own (its own
connection, so an abort reaches it in one round trip), and only node 0 reads the beats.
Requests per node per second are bounded by a constant that does not depend on N.

With --nnodes MIN:MAX (elastic) node 0 also decides who is in each round (elastic_rounds.py:
`round`, `a{k}/members`, `closed`); a late node's `join` first answers `waiting {round,
members}` and then joins the next round; node 0 restarts the job for it (an abort of kind
`membership`), and `joined` carries the round actually joined.

Every value read back is checked: one that no node of this job writes (the store has no
authentication, as under torchrun) becomes a root cause naming the key, never a crash.

Protocol with the supervisor: one JSON object per line; commands on stdin,
events on stdout (stderr is torch's own chatter, kept in the run's agent log). Each command
and event is a frozen class of agent_messages.py, decoded there once: a command in `handle`,
an event in the job link's reader (a line that is none is said on stderr and dropped).

    {"cmd": "join", "attempt": k, "record": {...}}   -> [waiting {round, members}] joined {round, members, nodes}
                                                        | join-timeout {missing} | join-closed
                                                        | abort {cause} then join-aborted
    {"cmd": "watch", "attempt": k}                   -> abort {cause} when any node publishes one
    {"cmd": "abort", "attempt": k, "cause": {...}}   -> abort {cause: the winner}
    {"cmd": "done", "attempt": k}
    {"cmd": "wait-done", "attempt": k, "timeout": s} -> [abort {cause}] then finished {missing: nodes not done}
    {"cmd": "alive", "attempt": k}                   -> alive {silent: [cause, ...]} within SILENT_S + 2 s:
                                                        after a failure, the nodes found dead (a worker's
                                                        "connection closed by peer" is then their
                                                        consequence, not the job's cause)
    {"cmd": "outcome", "outcome": {...}}             (a node other than 0: how it ended)
    {"cmd": "outcomes", "timeout": s}                -> outcomes {nodes: [outcome or null for nodes 1..]}
    {"cmd": "leave"}                                 (a node other than 0 is done with the store)
    {"cmd": "lines", "records": [...]}               console lines held for folding across nodes (cross_node.py):
                                                     to node 0 over the direct connection; on node 0 ->
                                                     lines {node, records} for each node's (its own too)
    {"cmd": "linger", "timeout": s}                  -> lingered {missing}: node 0 waited for every leave
    {"cmd": "regroup-claim" | "regroup-watch", ...}  a live recovery's rebuilt group (regroup_agent.py)
    {"cmd": "stand-by", "attempt": k, "record": {...}} a spare node (spare_node_agent.py) -> standing-by {attempt,
                                                     nodes} per round, then promoted {attempt, generation, node,
                                                     claim, nodes} | spare-closed | spare-refused {message, exit_code}
                                                     | spare-passed-over {message} (it was frozen when node 0 needed it)
    {"cmd": "move-out", "attempt": k, "node": r,     node 0: node r is a straggler (node_move_out.py) -> move-out
     "message": "..."}                               {node, why_not}: null once node r was told to leave; node r
                                                     then -> moved-out {message}, and it drops its direct connection
    (always possible)                                -> lost {message}: the store is gone

    python -m supervisor.rendezvous.node_agent_main NODE_RANK MIN_NODES:NNODES HOST PORT JOIN_TIMEOUT_S
        LAST_CALL_S [SILENT_S [LISTEN_FD]]
"""

from __future__ import annotations

import os
import selectors
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import orjson

from supervisor.rendezvous.agent_messages import (CheckAlive, ClaimRegroup, Command, Done, GatherOutcomes, Join,
                                                  Leave, Linger, Malformed, MoveNodeOut, PublishAbort, ShareLines, ShareOutcome,
                                                  StandBy, WaitDone, Watch, WatchRegroups, decode_command, encode,
                                                  event)
from supervisor.rendezvous.alive_check import AliveCheck
from supervisor.rendezvous.beat_watch import (BEAT_S, CHECK_BEAT_S, SILENT_S, OwnBeat, abort_key, done_key, node_key, nodes_key,
                                              publish)
from supervisor.rendezvous import (abort_wait, agent_causes, agent_end, elastic_join, fixed_join, regroup_agent,
                                   spare_node_agent, store_watchdog)
from supervisor.rendezvous.fixed_join import is_record
from supervisor.rendezvous.elastic_rounds import ElasticRounds
from supervisor.rendezvous import rank_claims
from supervisor.rendezvous.liveness import LIVENESS_KEY, LivenessLink, LivenessServer, link_to_node0
from supervisor.rendezvous.node0_judge import Judge, Nodes
from supervisor.rendezvous.own_lag import OwnLag
from supervisor.rendezvous.store_calls import Connect, StoreCalls, TimedStore, json_or_none


class Agent:
    def __init__(self, store: Any, node_rank: int, nnodes: int, join_timeout: float, where: str,
                 rounds: ElasticRounds | None = None, silent_s: float = SILENT_S) -> None:
        """`rounds`: an elastic job's (--nnodes MIN:MAX, `nnodes` is MAX); None: a fixed size. `silent_s`:
        system.node_silence_timeout, the silence after which a node (or, seen from the others, node 0) is gone."""
        self.store, self.silent_s = StoreCalls(store), silent_s
        self.beat = OwnBeat(self.store, node_rank)
        self.node_rank, self.nnodes = node_rank, nnodes
        self.rounds = rounds
        self.nodes = Nodes(nnodes, list(range(nnodes)), elastic=rounds is not None)
        self.join_timeout, self.where = join_timeout, where
        self.watching: int | None = None  # the attempt whose abort is not reported yet
        self.last_join: int | None = None
        self.mark = b""  # this agent's claim on its --node-rank (rank_claims.owner_mark), once it holds it
        self.lost = False
        self.leaving = False
        self.next_beat = 0.0
        self._emitting = threading.Lock()
        self._reported: set[int] = set()  # attempts whose abort was emitted
        self._reporting = threading.Lock()
        self.connect: Connect | None = None  # a fresh store connection for a thread that blocks (None: no threads)
        self.timed: list[TimedStore] = []  # the connections the watchdog looks at
        self._spare: list[StoreCalls] = []  # an abort wait's connection once that wait ended: the next one's
        self.liveness: LivenessLink | None = None
        self.liveness_at: str | None = None  # node 0: its liveness server's "host:port"
        self.liveness_server: LivenessServer | None = None  # node 0: every other agent's direct connection
        self.moved_out = False  # node 0 moved this node out: a spare node is this node now, not this agent
        # node 0: its judgement of the other nodes (their beats, their closed connections)
        self.judge = Judge(self.nodes, self.store, silent_s, self.report_abort, self._connection, lambda: self.lost)
        # `emit` looked up at each call: a test or the scale harness replaces it after construction
        self.alive = AliveCheck(self.store, self.nodes, self.judge, silent_s, where,
                                lambda name, **fields: self.emit(name, **fields))
        self._commands: dict[type[Command], Callable[[Any], None]] = {
            Join: self._join, Watch: self._watch, PublishAbort: self._abort, Done: self._done,
            WaitDone: self._wait_done, CheckAlive: self._alive, ShareOutcome: self._outcome,
            GatherOutcomes: self._outcomes, Leave: self._leave, Linger: self._linger,
            ShareLines: self._lines,
            ClaimRegroup: lambda cmd: regroup_agent.claim(self.store, self.emit, cmd),  # a live recovery
            WatchRegroups: self._regroup_watch, StandBy: self._stand_by,  # a spare node (--spare-nodes)
            MoveNodeOut: self._move_out,  # node 0: a straggler node to a spare node (node_move_out.py)
        }

    @property
    def own_lag(self) -> OwnLag | None:
        """Its own stalls: never another node's death (node 0's judge), nor node 0's silence (the others)."""
        return self.judge.own_lag

    @own_lag.setter
    def own_lag(self, lag: OwnLag | None) -> None:
        self.judge.own_lag = lag

    # ---------------------------------------------------------------- events
    def emit(self, name: str, **fields: Any) -> None:
        """The event `name` (agent_messages.py declares its fields) to the supervisor."""
        line = encode(event(name, **fields))
        with self._emitting:  # the loop, the abort wait, the liveness threads and the watchdog
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    def lose(self, message: str) -> None:
        if not self.lost:
            self.lost = True
            self.emit("lost", message=message)

    def report_abort(self, k: int, raw: bytes) -> None:
        """Attempt k's root cause, read from the store: emitted once, whichever thread reads it first."""
        with self._reporting:
            if k in self._reported:
                return
            self._reported.add(k)
        if self.watching == k:
            self.watching = None
        cause = self._cause(abort_key(k), raw)
        if cause.get("kind") == "node" and isinstance(cause.get("node"), int):
            self.nodes.gone.add(cause["node"])  # another agent found it dead
        self.emit("abort", attempt=k, cause=cause)

    def _cause(self, key: str, raw: bytes) -> dict[str, Any]:
        """A root cause read from the store; a value that is not one becomes a cause naming it."""
        return agent_causes.read(self.where, key, raw)

    def _malformed(self, key: str, raw: bytes, expected: str) -> dict[str, Any]:
        return agent_causes.malformed(self.where, key, raw, expected)

    # ---------------------------------------------------------------- commands
    def handle(self, raw: bytes | dict[str, Any]) -> None:
        """One command from the supervisor, decoded here once; one that is none is said and dropped."""
        try:
            cmd = decode_command(raw)
        except Malformed as exc:
            print(f"node agent: {exc}", file=sys.stderr, flush=True)
            return
        self._commands[type(cmd)](cmd)

    def _join(self, cmd: Join) -> None:
        k = cmd.attempt
        if not self._claim_rank(k, cmd.record):
            return
        fields = {**cmd.record, "owner": rank_claims.owner_mark(cmd.record).decode()}
        self.nodes.spare_nodes = int(fields.get("spare_nodes") or 0)
        self.nodes.min_replicas = int(fields.get("min_replicas") or 0)
        if self.liveness_at is not None:  # node 0: where the direct connections go, read with the records
            fields = {**fields, LIVENESS_KEY: self.liveness_at}
        record = orjson.dumps(fields)
        self._move_on()
        if self.rounds is not None:
            self._join_elastic(record)
            return
        if self.node_rank == 0:
            self.store.set(rank_claims.JOINING_KEY, str(k).encode())  # where a node started again joins
        elif self.last_join is None:  # started (again) while the job runs: node 0's round, or its restart's
            k = rank_claims.round_to_join(self.store, k)
        self.last_join = k
        got = fixed_join.join(self.store, k, self.node_rank, self.nnodes, record, self.join_timeout, self.where)
        if got.missing is not None:
            self.emit("join-timeout", attempt=k, missing=got.missing, timeout=self.join_timeout)
        elif got.abort is not None:
            self._join_aborted(k, got.abort)
        else:
            self._joined(k, list(range(self.nnodes)), got.records, lambda i: (nodes_key(k), got.nodes_raw))

    def _join_aborted(self, k: int, raw: bytes) -> None:
        self.emit("abort", attempt=k, cause=self._cause(abort_key(k), raw))
        self.emit("join-aborted", attempt=k)

    def _joined(self, k: int, members: list[int], records: list[Any],
                source: Callable[[int], tuple[str, bytes]]) -> None:
        """The members' join records, each checked: a value no gpuherd node writes is named
        (`source(i)`: the key it came from, and that key's value) as the job's cause instead of
        crashing this agent."""
        for i, record in enumerate(records):
            if not is_record(record):
                key, raw = source(i)
                cause = self._malformed(key, raw, f"node {members[i]}'s join record (host, nproc, settings)")
                self._join_aborted(k, publish(self.store, k, cause))
                return
        self.nodes.joined(members, records)
        self.beat.start(k)  # from now on: node 0 reads this node's beat
        if self.node_rank == 0:
            self.judge.watch(k)
        else:
            self._link_to_node0(records[members.index(0)].get(LIVENESS_KEY) if 0 in members else None)
        self.emit("joined", attempt=k, round=k, members=members, nodes=records)

    def _move_on(self) -> None:
        """Joining again: the attempt this node beat for stops expecting its beat."""
        self.beat.end(b"moved")
        self.judge.beats = None

    def _watch(self, cmd: Watch) -> None:
        k = cmd.attempt
        self.watching = k
        self.beat.start(k, fresh=False)
        if self.node_rank == 0:
            self.judge.watch(k)
        if self.connect is not None:
            threading.Thread(target=self._wait_abort, args=(k,), name=f"abort-wait-{k}", daemon=True).start()

    def _abort(self, cmd: PublishAbort) -> None:
        k = cmd.attempt
        winner = publish(self.store, k, cmd.cause)
        self.emit("abort", attempt=k, cause=self._cause(abort_key(k), winner))
        with self._reporting:
            self._reported.add(k)
        self.watching = None  # reported

    def _done(self, cmd: Done) -> None:
        if self.moved_out:
            return  # the spare node in its place says it
        self.store.set(done_key(cmd.attempt, self.node_rank), b"1")
        self.beat.end(b"done", cmd.attempt)

    def _wait_done(self, cmd: WaitDone) -> None:
        """Node 0: until every member's workers finished, the abort, or the timeout."""
        k = cmd.attempt
        abort, missing = agent_end.wait_done(self.store, k, self.nodes.waited_for(), cmd.timeout)
        if abort is not None:
            self.emit("abort", attempt=k, cause=self._cause(abort_key(k), abort))
        self.emit("finished", attempt=k, missing=missing)

    def _alive(self, cmd: CheckAlive) -> None:
        self.alive.begin(cmd.attempt, time.monotonic())
        self.next_beat = 0.0  # answer from the next reading on

    def _outcome(self, cmd: ShareOutcome) -> None:
        if self.moved_out:
            return  # node r's outcome is the spare node's in its place
        self.store.set(f"outcome{self.node_rank}", orjson.dumps(cmd.outcome))

    def _outcomes(self, cmd: GatherOutcomes) -> None:
        """Node 0: the others' (a node found dead is not waited for)."""
        others = [i for i in self.nodes.members if i != 0]  # elastic: the last round's nodes, not every rank up to MAX
        nodes = agent_end.outcomes(self.store, others, frozenset(self.nodes.gone), frozenset(self.nodes.lost_nodes),
                                   dict(self.nodes.hosts), cmd.timeout)
        self.emit("outcomes", ranks=others, nodes=nodes)

    def _lines(self, cmd: ShareLines) -> None:
        """Console lines this node's supervisor held for folding across nodes: to node 0's folding
        point over the direct connection (never the store); node 0's own, and a node without that
        connection's, come straight back as a `lines` event for its supervisor to print."""
        records = cmd.records
        if not records:
            return
        if self.liveness is not None:
            self.liveness.send_lines(orjson.dumps(records))
        else:
            self.emit("lines", node=self.node_rank, records=records)

    def _move_out(self, cmd: MoveNodeOut) -> None:
        """Node 0: its supervisor found node `cmd.node` a straggler: told to leave where a spare node
        takes its place (node0_judge.py); the answer says whether, and why not."""
        server = self.liveness_server
        why = self.judge.move_out(cmd.attempt, cmd.node, cmd.message,
                                  server.send_out if server is not None else lambda r, message: False)
        self.emit("move-out", attempt=cmd.attempt, node=cmd.node, why_not=why)

    def _moved_out(self, message: str) -> None:
        """Node 0 moved this node out (from the liveness link's thread): no more beats (the spare
        node taking its place beats as this node), its supervisor is told (it stops its workers at
        once), and the connection to node 0 is dropped without `bye`: node 0 hands the place over."""
        k = self.beat.attempt
        self.moved_out = True
        self.beat.attempt = None
        self.emit("moved-out", attempt=-1 if k is None else k, message=message)
        if self.liveness is not None:
            self.liveness.drop()

    def _node_lines(self, r: int, payload: bytes) -> None:
        """Node 0: another node's console lines, for its supervisor's folding point."""
        records = json_or_none(payload)
        if isinstance(records, list):
            self.emit("lines", node=r, records=records)

    def _leave(self, cmd: Leave) -> None:
        self.leaving = True
        self.beat.end(b"left")
        if not self.moved_out:  # else node r's `left` is the spare node's in its place
            self.store.set(f"left{self.node_rank}", b"1")
        if self.liveness is not None:
            self.liveness.bye()

    def _linger(self, cmd: Linger) -> None:
        """Node 0: the store stays up until every node that joined has read what it needs."""
        if self.rounds is not None:
            self.rounds.close_job()  # a node still waiting to be admitted stops waiting
        last = 0 if self.last_join is None else self.last_join  # node 0 may fail before its own join
        self.emit("lingered", missing=agent_end.linger(self.store, self.nodes.roster(last), cmd.timeout))

    # ---------------------------------------------------------------- elastic
    def _join_elastic(self, record: bytes) -> None:
        """Join the next round of an elastic job (elastic_join.py): node 0 decides who is in."""
        joined = elastic_join.join(self.store, self.rounds, record, self.join_timeout, self.where, self.emit)
        if joined is None:
            return  # said already
        k, members = joined
        self.last_join = k
        if members is None:
            self._join_aborted(k, self.store.get(abort_key(k)))
        else:
            keys = [node_key(k, r) for r in members]
            raws = self.store.multi_get(keys)
            self._joined(k, members, [json_or_none(raw) for raw in raws], lambda i: (keys[i], raws[i]))

    def _claim_rank(self, k: int, record: dict[str, Any]) -> bool:
        """The first agent to join as node r owns that --node-rank (its later attempts too) until
        node 0 finds it dead (rank_claims.py): a node started again then takes it back; another node
        started with it while its owner lives is refused alone, exit 2, before its record could
        overwrite the owner's. Once it holds the rank, this agent connects to node 0's (liveness.py):
        its death from now on, even while it waits in a join, frees the rank."""
        mine = rank_claims.owner_mark(record)
        owner = rank_claims.claim(self.store, self.node_rank, mine)
        if owner == mine:
            self.mark = mine
            if self.node_rank != 0:
                self._link_to_node0()
            return True
        self.emit("abort", attempt=k, cause=agent_causes.rank_taken(self.node_rank, record.get("host"), owner))
        self.emit("join-aborted", attempt=k)
        return False

    def _regroup_watch(self, cmd: WatchRegroups) -> None:
        """Every claim of round k's rebuilt groups, in order (regroup_agent.py), from a thread."""
        k = cmd.attempt
        if self.connect is not None:  # a test's in-process store has no second connection: nothing to wait on
            threading.Thread(target=self._follow_claims, args=(k,), name=f"regroup-wait-{k}", daemon=True).start()

    def _follow_claims(self, k: int) -> None:
        over = lambda: self.lost or self.leaving or k in self._reported or self._moved_past(k)  # noqa: E731
        for g, claimed in regroup_agent.follow(self._connection, self._spare.append, k, over):
            self.nodes.gone.update(regroup_agent.lost_whole(claimed))  # the job went on without it: no `alive` waits
            self.emit("regroup", attempt=k, generation=g, claim=claimed)

    def _moved_past(self, k: int) -> bool:
        return self.last_join is not None and self.last_join > k

    def _stand_by(self, cmd: StandBy) -> None:
        """A spare node (spare_node_agent.py): from round k on it stands by, in a thread (it keeps beating)."""
        k = cmd.attempt
        if not self._claim_rank(k, cmd.record):
            return
        if self.connect is None:  # a test's in-process store: no second connection, no thread
            self._become(spare_node_agent.stand_by(self.store, self._spare_node(), k, cmd.record))
            return
        threading.Thread(target=self._follow_rounds, args=(k, cmd.record), name="spare-node", daemon=True).start()

    def _follow_rounds(self, k: int, record: dict[str, Any]) -> None:
        try:
            promotion = spare_node_agent.stand_by(self._connection(), self._spare_node(), k, record)
        except RuntimeError as exc:
            self.lose(f"lost the job store at {self.where} (node 0 gone?): {' '.join(str(exc).split())[:200]}")
            return
        self._become(promotion)

    def _spare_node(self) -> spare_node_agent.SpareNode:
        return spare_node_agent.SpareNode(self.node_rank, self.mark, self.where, self.emit, self._link_to_node0)

    def _become(self, promotion: spare_node_agent.Promotion | None) -> None:
        """This spare node is node r from now on: its beat, done, outcome and leave are node r's."""
        if promotion is None:
            return  # it stopped standing by (said already)
        k, r = promotion.k, promotion.node  # node 0 handed this agent rank r's claim (rank_claims.transfer)
        self.node_rank, self.nodes.members = r, list(range(self.nnodes))
        self.nodes.hosts = {i: str(n.get("host", "?")) for i, n in enumerate(promotion.nodes)}
        self.last_join = k
        self.beat.node_rank = r
        self.beat.start(k)
        if self.liveness is not None:
            self.liveness.hello(r)
        self.emit("promoted", attempt=k, generation=promotion.generation, node=r, claim=promotion.claim,
                  nodes=promotion.nodes)

    # ---------------------------------------------------------------- once a second
    def poll(self) -> None:
        """The loop's tick: this node's beat; on node 0, the one reading of every beat."""
        if self.watching is not None and self.connect is None and self.store.check([abort_key(self.watching)]):
            self.report_abort(self.watching, self.store.get(abort_key(self.watching)))  # no abort-wait thread
            return
        now = time.monotonic()
        if now < self.next_beat:
            return
        # Set even when there is nothing to do: the loop sleeps until it (a deadline left in the
        # past made the loop spin, a core per idle agent, before its join and between attempts).
        self.next_beat = now + (CHECK_BEAT_S if self.alive.pending is not None else BEAT_S)
        if self.beat.attempt is None and self.alive.pending is None and self.judge.beats is None:
            return
        if self.beat.attempt is not None:
            self.beat.tick()
        if self.judge.beats is not None:
            self.judge.read_beats(now)
            if self.rounds is not None and self.watching is not None:
                elastic_join.admit_waiting(self.store, self.rounds, self.watching)
        if self.alive.pending is not None:
            self.alive.poll(now, self.node_rank)

    # ---------------------------------------------------------------- threads (a real store only)
    def _wait_abort(self, k: int) -> None:
        """Attempt k's abort, from a thread with a connection of its own (abort_wait.py)."""
        try:
            conn = self._connection()
            raw = abort_wait.wait(conn, k, self.node_rank, lambda: self.lost or k in self._reported,
                                  lambda: self.leaving or self._moved_past(k))
            if raw is not None:
                self.report_abort(k, raw)
            self._spare.append(conn)  # a restart's wait reuses it: no new connection per attempt
        except RuntimeError as exc:
            if not self.leaving:
                self.lose(f"lost the job store at {self.where} (node 0 gone?): {_short(exc)}")

    def _connection(self) -> StoreCalls:
        with self._reporting:
            if self._spare:
                return self._spare.pop()
        store = self.connect()
        if isinstance(store, TimedStore):
            self.timed.append(store)
        return StoreCalls(store)

    def serve_liveness(self, host: str) -> None:
        """Node 0: the port every other agent connects to (liveness.py), published on the store."""
        server = self.liveness_server = LivenessServer(host, self.judge.connection_closed, self._node_lines)
        self.liveness_at = f"{host}:{server.port}"
        self.store.set(LIVENESS_KEY, self.liveness_at.encode())

    def _link_to_node0(self, where: str | None = None) -> None:
        """Connect to node 0's agent once (none in a test's in-process store: no threads)."""
        if self.connect is not None and self.liveness is None:
            self.liveness = link_to_node0(where, self.store.get_if_set, self.node_rank, self._node0_closed, self.mark,
                                          self.silent_s, self._moved_out)

    def _node0_closed(self) -> None:
        self.lose(f"lost the job store at {self.where} (node 0 gone?): node 0's node agent closed its connection "
                  "(node 0's supervisor or machine died)")

    def watch_store(self) -> None:
        """A node other than 0: node 0's job store answered nothing for silent_s (store_watchdog.py):
        said, and the agent ends (a blocked call keeps the loop, so the verdict ends it too)."""
        store_watchdog.watch_store(self.timed, self.silent_s, self.own_lag, lambda: self.lost)
        self.lose(store_watchdog.store_silence(self.where, self.silent_s))
        os._exit(1)


def serve(agent: Agent) -> None:
    """The agent's loop: the supervisor's commands from stdin, and its tick (`poll`) at least every beat."""
    sel = selectors.DefaultSelector()
    stdin = sys.stdin.buffer
    os.set_blocking(stdin.fileno(), False)
    sel.register(stdin.fileno(), selectors.EVENT_READ)
    pending = b""
    while True:
        if sel.select(max(0.0, min(BEAT_S, agent.next_beat - time.monotonic()))):
            chunk = os.read(stdin.fileno(), 1 << 16)
            if not chunk:
                return  # the supervisor is gone or done with us
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.strip():
                    guarded(agent, lambda line=line: agent.handle(line))
        guarded(agent, agent.poll)


def guarded(agent: Agent, action: Any) -> None:
    """`action` unless the store is lost; a store that fails it is lost (said once)."""
    if agent.lost:
        return
    try:
        action()
    except RuntimeError as exc:  # torch's DistError family: the store (node 0) is unreachable
        agent.lose(f"lost the job store at {agent.where} (node 0 gone?): {_short(exc)}")


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split("Exception raised from")[0].split())[:200]


def main(argv: list[str]) -> int:
    node_rank, host, port, join_timeout = int(argv[0]), argv[2], int(argv[3]), float(argv[4])
    min_nodes, nnodes = (int(n) for n in argv[1].split(":"))
    last_call = float(argv[5])
    silent_s = float(argv[6]) if len(argv) > 6 else SILENT_S
    listen_fd = int(argv[7]) if len(argv) > 7 else None
    where = f"{host}:{port}"
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=join_timeout)
    try:
        if node_rank == 0:
            store = TCPStore(host, port, None, True, timeout, wait_for_workers=False, master_listen_fd=listen_fd)
            connect: Connect = lambda: TCPStore(host, port, None, False, timeout)  # noqa: E731
        else:
            store = TimedStore(TCPStore(host, port, None, False, timeout))
            connect = lambda: TimedStore(TCPStore(host, port, None, False, timeout))  # noqa: E731
    except RuntimeError as exc:
        sys.stdout.buffer.write(orjson.dumps({"event": "join-timeout", "attempt": 0, "missing": [0],
                                              "timeout": join_timeout, "unreachable": True,
                                              "detail": _short(exc)}) + b"\n")
        sys.stdout.buffer.flush()
        return 5
    rounds = None
    if min_nodes < nnodes:
        rounds = ElasticRounds(store, node_rank, min_nodes, nnodes, join_timeout, last_call)
    agent = Agent(store, node_rank, nnodes, join_timeout, where, rounds, silent_s)
    agent.connect = connect
    agent.own_lag = OwnLag()  # node 0: its stalls are nobody's silence; the others: not node 0's either
    if node_rank == 0:
        agent.serve_liveness(host)
    else:
        agent.timed.append(store)
        threading.Thread(target=agent.watch_store, name="store-watchdog", daemon=True).start()
    serve(agent)
    # Leave at once: an interpreter teardown would first wait out the abort wait blocked in the
    # store (seconds), and the supervisor waits for this exit at the end of every job.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
