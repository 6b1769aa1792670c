"""One node's link to the job store, in a helper process (multi-node runs only).

The supervisor stays torch-free; this process imports torch for its `TCPStore`,
which node 0 hosts on `--master-addr:--master-port` (from a socket the supervisor
bound, so a busy port fails before anything starts) and every node's agent uses as
a client. Keys, per attempt k (names in beat_watch.py):

    a{k}/node{r}   node r's join record (JSON: host, nproc, config hash, ...)
    a{k}/nodes     every node's join record in one value (a JSON list), written by the node whose
                   record came last: each node then reads one key, not N
    a{k}/all       the join is decided: "in" (set by the node whose record came last, after a{k}/nodes)
                   or "abort"
    a{k}/abort     the job's root cause: the first failure any node publishes
                   (compare_set: first writer wins, everyone reads the same one)
    a{k}/done{r}   node r's workers all finished
    a{k}/beat{r}   node r's heartbeat counter, set by node r every BEAT_S from its join until it
                   leaves ("left"), finishes ("done") or joins attempt k+1 ("moved"); node 0
                   alone reads them all (one multi_get per BEAT_S) and publishes "node r stopped
                   responding" as the abort when one stands still for SILENT_S (system.node_silence_timeout)
    a{k}/verdict   node 0's latest reading of the beats: {seq, moved: {r: seq it last moved}, dead:
                   [causes]}, for an `alive` check on any node
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
                                                  Leave, Linger, Malformed, PublishAbort, ShareLines, ShareOutcome,
                                                  StandBy, WaitDone, Watch, WatchRegroups, decode_command, encode,
                                                  event)
from supervisor.rendezvous.beat_watch import (BEAT_S, SETTLED, SILENT_S, BeatWatch, abort_key, beat_key, done_key,
                                              node_key, nodes_key, parse_verdict, publish, undecided, verdict_key)
from supervisor.rendezvous import (agent_causes, agent_end, elastic_join, fixed_join, node_shrink_agent,
                                   regroup_agent, spare_node_agent, store_watchdog)
from supervisor.rendezvous.fixed_join import is_record
from supervisor.rendezvous.elastic_rounds import ElasticRounds
from supervisor.rendezvous import rank_claims
from supervisor.rendezvous.liveness import LIVENESS_KEY, LivenessLink, LivenessServer
from supervisor.rendezvous.own_lag import OwnLag
from supervisor.rendezvous.roster import Roster
from supervisor.rendezvous.store_calls import Connect, StoreCalls, TimedStore, json_or_none

ABORT_WAIT_S = 30.0  # the abort wait's pieces (two requests each: the wait, and its cancel when it ran out)
GOLDEN = 0.6180339887498949  # node r's first piece: consecutive ranks land far apart in the period
CLOSED_GRACE_S = 5.0  # a node named dead by its closed connection: survivors stop their workers this long after
# node 0 ran again after a stall: connections that close this long after it are the stall's doing (the
# other nodes' watchdogs give node 0 up within a beat or two of SILENT_S without an answer)
STALL_MARGIN_S = 5.0


class Agent:
    def __init__(self, store: Any, node_rank: int, nnodes: int, join_timeout: float, where: str,
                 rounds: ElasticRounds | None = None, silent_s: float = SILENT_S) -> None:
        """`rounds`: an elastic job's (--nnodes MIN:MAX, `nnodes` is MAX); None: a fixed size. `silent_s`:
        system.node_silence_timeout, the silence after which a node (or, seen from the others, node 0) is gone."""
        self.store, self.silent_s = StoreCalls(store), silent_s
        self.node_rank, self.nnodes = node_rank, nnodes
        self.rounds = rounds
        self.members = list(range(nnodes))  # the nodes in the round being run
        self.join_timeout, self.where = join_timeout, where
        self.watching: int | None = None  # the attempt whose abort is not reported yet
        self.beating: int | None = None  # the attempt whose beat key this agent sets
        self.verifying: tuple[int, float, int] | None = None  # an "alive" check: (attempt, began, verdict seq then)
        self.beats: BeatWatch | None = None  # node 0: the attempt whose beats it reads
        self.last_join: int | None = None
        self.mark = b""  # this agent's claim on its --node-rank (rank_claims.owner_mark), once it holds it
        self.lost = False
        self.leaving = False
        self.hosts: dict[int, str] = {}
        self.owners: dict[int, bytes] = {}  # node 0: each node's agent in the round (rank_claims.owner_mark)
        self.gone: set[int] = set()  # nodes found dead: nobody waits for them to leave
        self.spare_nodes = 0  # node 0: --spare-nodes (from its own join record)
        self.promoted: dict[int, dict[int, int]] = {}  # node 0: round -> {dead node: the spare node in its place}
        self.min_replicas = 0  # node 0: --min-replicas (from its own join record): a dead node may shrink the job
        self.lost_nodes: set[int] = set()  # node 0: nodes dead whole the round went on without (node_shrink_agent.py)
        self._naming = threading.Lock()  # node 0: one dead node judged at a time (the loop, the liveness thread)
        self._next_beat = 0.0
        self._beat_count = 0
        self._beat_sent = b"0"  # the value this node's beat key holds (enter() writes "0")
        self._emitting = threading.Lock()
        self._reported: set[int] = set()  # attempts whose abort was emitted
        self._reporting = threading.Lock()
        self.connect: Connect | None = None  # a fresh store connection for a thread that blocks (None: no threads)
        self.timed: list[TimedStore] = []  # the connections the watchdog looks at
        self._spare: list[StoreCalls] = []  # an abort wait's connection once that wait ended: the next one's
        self.liveness: LivenessLink | None = None
        self.liveness_at: str | None = None  # node 0: its liveness server's "host:port"
        self._liveness_store: StoreCalls | None = None  # node 0: the connection its liveness thread names nodes on
        self.own_lag: OwnLag | None = None  # its own stalls: never another node's death, nor node 0's silence
        self._commands: dict[type[Command], Callable[[Any], None]] = {
            Join: self._join, Watch: self._watch, PublishAbort: self._abort, Done: self._done,
            WaitDone: self._wait_done, CheckAlive: self._alive, ShareOutcome: self._outcome,
            GatherOutcomes: self._outcomes, Leave: self._leave, Linger: self._linger,
            ShareLines: self._lines,
            ClaimRegroup: lambda cmd: regroup_agent.claim(self.store, self.emit, cmd),  # a live recovery
            WatchRegroups: self._regroup_watch, StandBy: self._stand_by,  # a spare node (--spare-nodes)
        }

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
            self.gone.add(cause["node"])  # another agent found it dead
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
        self.spare_nodes = int(fields.get("spare_nodes") or 0)
        self.min_replicas = int(fields.get("min_replicas") or 0)
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
        self.hosts = {i: str(n.get("host", "?")) for i, n in zip(members, records, strict=True)}
        self.owners = {i: str(n.get("owner", "")).encode() for i, n in zip(members, records, strict=True)}
        self.members = members
        self.lost_nodes.clear()  # a restart's join waited for every node again
        self.beating, self._beat_sent = k, b"0"  # from now on: node 0 reads this node's beat
        if self.node_rank == 0:
            self.beats = BeatWatch(k, self.silent_s)  # from the join on: a node dying before its workers start is named too
        else:
            self._link_to_node0(records[members.index(0)].get(LIVENESS_KEY) if 0 in members else None)
        self.emit("joined", attempt=k, round=k, members=members, nodes=records)

    def _move_on(self) -> None:
        """Joining again: the attempt this node beat for stops expecting its beat."""
        if self.beating is not None:
            self.store.set(beat_key(self.beating, self.node_rank), b"moved")
            self.beating = None
        self.beats = None

    def _watch(self, cmd: Watch) -> None:
        k = cmd.attempt
        self.watching = self.beating = k
        if self.node_rank == 0 and (self.beats is None or self.beats.k != k):
            self.beats = BeatWatch(k, self.silent_s)
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
        k = cmd.attempt
        self.store.set(done_key(k, self.node_rank), b"1")
        if self.beating == k:
            self.store.set(beat_key(k, self.node_rank), b"done")
            self.beating = None

    def _wait_done(self, cmd: WaitDone) -> None:
        """Node 0: until every member's workers finished, the abort, or the timeout."""
        k = cmd.attempt
        members = [i for i in self.members if i not in self.lost_nodes]  # a node the job went on without never is
        abort, missing = agent_end.wait_done(self.store, k, members, cmd.timeout)
        if abort is not None:
            self.emit("abort", attempt=k, cause=self._cause(abort_key(k), abort))
        self.emit("finished", attempt=k, missing=missing)

    def _alive(self, cmd: CheckAlive) -> None:
        k = cmd.attempt
        verdict = self._verdict(k)
        self.verifying = (k, time.monotonic(), verdict["seq"] if verdict is not None else 0)
        self._next_beat = 0.0  # answer from the next reading on

    def _outcome(self, cmd: ShareOutcome) -> None:
        self.store.set(f"outcome{self.node_rank}", orjson.dumps(cmd.outcome))

    def _outcomes(self, cmd: GatherOutcomes) -> None:
        """Node 0: the others' (a node found dead is not waited for)."""
        others = [i for i in self.members if i != 0]  # elastic: the last round's nodes, not every rank up to MAX
        nodes = agent_end.outcomes(self.store, others, frozenset(self.gone), frozenset(self.lost_nodes),
                                   dict(self.hosts), cmd.timeout)
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

    def _node_lines(self, r: int, payload: bytes) -> None:
        """Node 0: another node's console lines, for its supervisor's folding point."""
        records = json_or_none(payload)
        if isinstance(records, list):
            self.emit("lines", node=r, records=records)

    def _leave(self, cmd: Leave) -> None:
        self.leaving = True
        if self.beating is not None:
            self.store.set(beat_key(self.beating, self.node_rank), b"left")
            self.beating = None
        self.store.set(f"left{self.node_rank}", b"1")
        if self.liveness is not None:
            self.liveness.bye()

    def _linger(self, cmd: Linger) -> None:
        """Node 0: the store stays up until every node that joined has read what it needs."""
        if self.rounds is not None:
            self.rounds.close_job()  # a node still waiting to be admitted stops waiting
        last = 0 if self.last_join is None else self.last_join  # node 0 may fail before its own join
        self.emit("lingered", missing=agent_end.linger(self.store, self._roster(last), cmd.timeout))

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
            self.gone.update(regroup_agent.lost_whole(claimed))  # the job went on without it: no `alive` waits
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
        self.node_rank, self.members = r, list(range(self.nnodes))
        self.hosts = {i: str(n.get("host", "?")) for i, n in enumerate(promotion.nodes)}
        self.last_join = k
        self.beating, self._beat_sent = k, b"0"
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
        if now < self._next_beat:
            return
        # Set even when there is nothing to do: the loop sleeps until it (a deadline left in the
        # past made the loop spin, a core per idle agent, before its join and between attempts).
        self._next_beat = now + BEAT_S
        if self.beating is None and self.verifying is None and self.beats is None:
            return
        if self.beating is not None:
            self._beat()
        if self.beats is not None:
            self._read_beats(now)
            if self.rounds is not None and self.watching is not None:
                elastic_join.admit_waiting(self.store, self.rounds, self.watching)
        if self.verifying is not None:
            self._verify_alive(now)

    def _beat(self) -> None:
        """One request with an answer (compare_set: a plain set is never answered, so a partition
        would go unseen): the store watchdog sees node 0 gone when it stays unanswered. Not `add`:
        a foreign value in the key cannot break our connection; it is replaced at the next beat."""
        self._beat_count += 1
        value = str(self._beat_count).encode()
        got = self.store.compare_set(beat_key(self.beating, self.node_rank), self._beat_sent, value)
        self._beat_sent = value if got == value else got

    def _read_beats(self, now: float) -> None:  # node 0 only (self.beats)
        """Node 0: every other member's beat in one request; one that stood still is named."""
        beats = self.beats
        others = [r for r in self.members if r != self.node_rank and r not in self.lost_nodes]
        values = self.store.multi_get([beat_key(beats.k, r) for r in others])
        if self.own_lag is not None:  # node 0 did not read while it stood still: that time is nobody's silence
            beats.pause(self.own_lag.take_new())
        for r, still in beats.observe(others, values, now):
            self._declare(beats.k, r, self._silent(r, f"no heartbeat for {still:.0f} s"), self.store)
        self.store.set(verdict_key(beats.k), orjson.dumps(beats.verdict()))

    def _silent(self, r: int, why: str) -> dict[str, Any]:
        return agent_causes.silent(r, self.hosts.get(r, "?"), why)

    def _declare(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> None:
        """Node 0: node r is dead; its cause goes to every node (the abort, unless a failure came first),
        unless a spare node takes its place or the job goes on without it."""
        owner = self.owners.get(r)
        if self._go_on_without(k, r, cause, store):
            if r in self.lost_nodes:  # the job went on without it: node r started again may take its rank
                rank_claims.release(store, r, owner)
            return
        rank_claims.release(store, r, owner)  # node r started again takes its rank back
        if self.beats is not None and self.beats.k == k:
            self.beats.dead[r] = cause
            store.set(verdict_key(k), orjson.dumps(self.beats.verdict()))  # named dead before the abort is read
        self.gone.add(r)
        self.report_abort(k, publish(store, k, cause))

    def _go_on_without(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> bool:
        """Node 0: True when round k goes on without dead node r: a spare node takes its place
        (spare_node_agent.py), else, with --min-replicas, the job shrinks (node_shrink_agent.py)."""
        with self._naming:
            if r in self.lost_nodes:
                return True  # judged already (its silence and its closed connection both name it)
            return self._spare_node_takes(k, r, cause, store) or self._shrink_without(k, r, cause, store)

    def _roster(self, k: int) -> Roster:
        """What the friend modules read of round k's nodes: a copy, never this agent's own sets."""
        return Roster(k, self.nnodes, self.spare_nodes, self.min_replicas, self.rounds is not None,
                      frozenset(self.gone), dict(self.promoted.get(k, {})), dict(self.owners))

    def _spare_node_takes(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> bool:
        """Node 0: a spare node standing by takes dead node r's place (spare_node_agent.py): from now
        on it is node r here (its claim, its host; its beat not yet due), then it is told so."""
        took = spare_node_agent.take_over(store, self._roster(k), r, cause["message"])
        self.gone.update(took.passed_over)  # frozen spare nodes: never chosen again
        hand = took.handover
        if hand is None:
            return False
        self.owners[r] = hand.mark
        self.promoted.setdefault(k, {})[r] = hand.spare
        self.hosts[r] = hand.host
        if self.beats is not None and self.beats.k == k:
            self.beats.dead.pop(r, None)
            self.beats.forget(r)
        self.gone.discard(r)
        spare_node_agent.promote(store, k, hand)
        return True

    def _shrink_without(self, k: int, r: int, cause: dict[str, Any], store: StoreCalls) -> bool:
        """Node 0, no spare node free: with --min-replicas the job goes on without dead node r
        (node_shrink_agent.py), waiting for it no more; else `cause` says why not, where the floor is why."""
        shrink = node_shrink_agent.shrink_over(store, self._roster(k), r, cause["message"])
        cause["message"] += shrink.why_not
        if not shrink.claimed:
            return False
        self.lost_nodes.add(r)
        self.gone.add(r)
        if self.beats is not None and self.beats.k == k:
            self.beats.forget(r)
        return True

    def _verdict(self, k: int) -> dict[str, Any] | None:
        """Node 0's latest reading of attempt k's beats (its own, on node 0); None: a foreign value."""
        if self.beats is not None and self.beats.k == k:
            return self.beats.verdict()
        return parse_verdict(self.store.get_if_set(verdict_key(k)))

    def _verify_alive(self, now: float) -> None:
        """An `alive` check: done once node 0's reading proves each node alive since the check began
        or names it dead; undecided ones are waited for at most silent_s + 2 s (then counted alive)."""
        k, began, seq0 = self.verifying
        verdict = self._verdict(k)
        if verdict is None:
            self.verifying = None
            self.emit("alive", attempt=k, silent=[self._malformed(verdict_key(k), self.store.get(verdict_key(k)),
                                                                  "node 0's reading of the heartbeats")])
            return
        ranks = [r for r in self.members if r not in (0, self.node_rank) and r not in self.gone]
        silent = [c for c in verdict["dead"] if c["node"] != self.node_rank]
        if not silent and undecided(verdict, seq0, ranks) and now - began < self.silent_s + 2:
            return  # a node named dead answers at once: the first one is the cause, whoever else is alive
        self.verifying = None
        self.gone.update(c["node"] for c in silent)
        self.emit("alive", attempt=k, silent=silent)

    # ---------------------------------------------------------------- threads (a real store only)
    def _wait_abort(self, k: int) -> None:
        """Blocks on attempt k's abort key in a connection of its own: one round trip after any node
        publishes, this node has it, at no request while nothing happens."""
        try:
            conn = self._connection()
            piece = renewal_offset(self.node_rank)  # the first piece spreads every node's renewals over the period
            while not self.lost and k not in self._reported:
                if conn.wait([abort_key(k)], piece):
                    # The key exists now: compare_set with "" expected returns its value untouched, in one
                    # round trip (torch's `get` is two: a wait, then the get), for every node at once.
                    self.report_abort(k, conn.compare_set(abort_key(k), "", b""))
                    break
                if self.leaving or self._moved_past(k):
                    break
                piece = ABORT_WAIT_S
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
        server = LivenessServer(host, self._connection_closed, self._node_lines)
        self.liveness_at = f"{host}:{server.port}"
        self.store.set(LIVENESS_KEY, self.liveness_at.encode())

    def _connection_closed(self, r: int, mark: bytes | None) -> None:
        """Node 0: node r's connection ended without a goodbye: its agent (`mark`, its claim on the
        rank) died with its processes. It is dead in the verdict and published as every node's
        root cause at once (named on every survivor within one fan-out), and its rank is free for
        the node started again in its place. The cause carries `stop_after_s` (CLOSED_GRACE_S):
        each survivor's supervisor stops its workers only that long after, so that its workers,
        failing on the same closed connections at their next collective, fail first and are
        recorded as the dead node's consequence, not cut short by the stop."""
        try:
            if self._liveness_store is None:
                self._liveness_store = self._connection()
            conn = self._liveness_store
            beats = self.beats  # a spare node given node r's place: node r died
            r = spare_node_agent.promoted_as(self.promoted.get(beats.k, {}) if beats is not None else {}, r)
            if r >= self.nnodes or beats is None or r not in self.members or r in beats.dead \
                    or r in self.lost_nodes or self.lost:
                self.gone.update([r] if r >= self.nnodes else [])  # a spare node standing by: no longer one
                rank_claims.release(conn, r, mark)  # between attempts: the next join names it
                return
            if conn.get_if_set(beat_key(beats.k, r)) in SETTLED:
                rank_claims.release(conn, r, mark)
                return
            stall = self._own_stall()
            cause = agent_causes.stalled(self.hosts.get(0, "?"), r, stall, self.silent_s) if stall is not None else \
                {**self._silent(r, "its connection to node 0 closed without a goodbye"), "stop_after_s": CLOSED_GRACE_S}
            self._declare(beats.k, r, cause, conn)
        except RuntimeError as exc:
            print(f"node agent: could not name node {r}: {_short(exc)}", file=sys.stderr, flush=True)

    def _own_stall(self) -> float | None:
        """Node 0: how long it stood still lately, where that was long enough for every other
        node's store watchdog to give it up (silent_s unanswered); None: no such stall."""
        if self.own_lag is None or self.node_rank != 0:
            return None
        self.own_lag.tick()  # a stall still unseen by the ticker (this thread ran first) counts too
        stall = self.own_lag.stalled_within(STALL_MARGIN_S)
        return stall if stall is not None and stall >= self.silent_s - BEAT_S else None

    def _link_to_node0(self, where: str | None = None) -> None:
        """Connect to node 0's agent once (none in a test's in-process store: no threads). `where`:
        node 0's "host:port" as its join record carries it (no request); else the store's key."""
        if self.connect is None or self.liveness is not None:
            return
        if not isinstance(where, str):
            raw = self.store.get_if_set(LIVENESS_KEY)
            if raw is None:
                return  # node 0 has none (a test's store): the heartbeat silence rule still holds
            where = raw.decode(errors="replace")
        host, _, port = where.rpartition(":")
        try:
            self.liveness = LivenessLink(host, int(port), self.node_rank, self._node0_closed, self.mark)
        except (OSError, ValueError) as exc:
            print(f"node agent: no direct connection to node 0's agent at {where!r} ({exc}); a dead node is "
                  f"named after {self.silent_s:g} s of silence instead", file=sys.stderr, flush=True)

    def _node0_closed(self) -> None:
        self.lose(f"lost the job store at {self.where} (node 0 gone?): node 0's node agent closed its connection "
                  "(node 0's supervisor or machine died)")

    def watch_store(self) -> None:
        """A node other than 0: node 0's job store answered nothing for silent_s (store_watchdog.py):
        said, and the agent ends (a blocked call keeps the loop, so the verdict ends it too)."""
        store_watchdog.watch_store(self.timed, self.silent_s, self.own_lag, lambda: self.lost)
        self.lose(store_watchdog.store_silence(self.where, self.silent_s))
        os._exit(1)

    # ---------------------------------------------------------------- the loop
    def serve(self) -> None:
        sel = selectors.DefaultSelector()
        stdin = sys.stdin.buffer
        os.set_blocking(stdin.fileno(), False)
        sel.register(stdin.fileno(), selectors.EVENT_READ)
        pending = b""
        while True:
            if sel.select(max(0.0, min(BEAT_S, self._next_beat - time.monotonic()))):
                chunk = os.read(stdin.fileno(), 1 << 16)
                if not chunk:
                    return  # the supervisor is gone or done with us
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._guarded(lambda line=line: self.handle(line))
            self._guarded(self.poll)

    def _guarded(self, action: Any) -> None:
        if self.lost:
            return
        try:
            action()
        except RuntimeError as exc:  # torch's DistError family: the store (node 0) is unreachable
            self.lose(f"lost the job store at {self.where} (node 0 gone?): {_short(exc)}")


def renewal_offset(node_rank: int) -> float:
    """How long node r's first abort wait lasts: between ABORT_WAIT_S / 2 and 3 / 2 of it, spread
    evenly over the nodes (golden-ratio steps), so that the renewals of N waits that began at
    one join never reach the store at once (its cancel of a wait scans every waiter)."""
    return ABORT_WAIT_S * (0.5 + (node_rank * GOLDEN) % 1.0)


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
    agent.serve()
    # Leave at once: an interpreter teardown would first wait out the abort wait blocked in the
    # store (seconds), and the supervisor waits for this exit at the end of every job.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
