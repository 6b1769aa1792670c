"""This node's link to a multi-node job: the agent process and the events it reports.

Node 0 hosts the job store (`supervisor/rendezvous/node_agent_main.py`, on --master-addr:--master-port,
bound to that interface only); every node's supervisor talks to it through its own
agent process. Per attempt: every node publishes a join record and waits for all
the others (a node that does not come within the join timeout is named: exit 5);
ranks are laid out node by node (node r's first rank = the workers of nodes < r);
node 0 also publishes the port of that attempt's worker rendezvous store and the
checkpoint a restart resumes from, so every node hands its workers the same ones.

The first failure any node publishes is the job's root cause (first writer wins in
the store); every other node tears its workers down as soon as it sees it and
reports that same cause — not a cascade of NCCL timeouts ten minutes later. When a
node dies whole, the survivors' workers usually fail first ("connection closed by
peer") and publish that; each survivor then asks its agent which nodes stopped beating
(`silent_nodes`) and names the dead node as the cause, the workers' error as its
consequence.
"""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loguru import logger

from gpuherd.exit_codes import ExitCode
from gpuherd.files import open_log
from supervisor.rendezvous.agent_messages import (Aborted, AliveChecked, Event, Finished, JoinAborted, JoinClosed,
                                                  Joined, JoinTimedOut, Lines, Lost, Malformed, MovedOut, Outcomes,
                                                  Promoted,
                                                  SpareClosed, SparePassedOver, SpareRefused, StandingBy, Waiting,
                                                  command, decode_event, encode)
from supervisor.rendezvous.beat_watch import SILENT_S
from supervisor.rendezvous.nodes import NodeLinkError, NodeSpec, SpareNodeUnused
from supervisor.rendezvous.store import store_host_env
from supervisor.rendezvous.wire_cause import HeardCause, decode_cause
from supervisor.summary import CauseKind, RootCause

SILENT_CHECK_S = 20.0  # the agent answers an "alive" check within its silent_s + 2 s: waited this much beyond
STOP_AFTER_MAX_S = 30.0  # a cause's `stop_after_s` beyond this is not node 0's agent's: stop at once


class JobLink:
    """This node's agent process and the events it reports."""

    def __init__(self, spec: NodeSpec, join_timeout: float, python: str, env: dict[str, str],
                 preexec: Callable[[], None], log_path: Path, listen: socket.socket | None,
                 last_call: float = 0.0, silent_s: float = SILENT_S) -> None:
        """`last_call`: an elastic job's (--nnodes MIN:MAX) wait for more nodes once MIN joined; `silent_s`:
        system.node_silence_timeout, after which a node (or node 0, seen from the others) is given up."""
        self.spec, self.join_timeout, self.last_call, self.silent_s = spec, join_timeout, last_call, silent_s
        self.where = f"{spec.master_addr}:{spec.master_port}"
        self._replies: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._aborts: dict[int, RootCause] = {}
        self._abort_seen = threading.Condition()
        self._on_abort: dict[int, Callable[[RootCause], None]] = {}
        self.lost: str | None = None
        self.moved_out: str | None = None  # node 0 moved this node out as a straggler: its words
        self._on_lost: Callable[[str], None] | None = None
        self._callbacks = threading.Lock()  # unwatch() waits for a callback in progress
        self._listeners: dict[str, Callable[[Any], None]] = {}  # other events by kind (listen())
        self._on_lines: Callable[[int, list[Any]], None] | None = None  # node 0: every node's folded lines
        self._log = os.fdopen(open_log(log_path), "ab")  # the agent writes to it for the whole job
        argv = [python, "-m", "supervisor.rendezvous.node_agent_main", str(spec.node_rank),
                f"{spec.min_nodes or spec.nnodes}:{spec.nnodes}", spec.master_addr, str(spec.master_port),
                str(join_timeout), str(last_call), str(silent_s)]
        fds: tuple[int, ...] = ()
        if listen is not None:
            argv.append(str(listen.fileno()))
            fds = (listen.fileno(),)
        if spec.node_rank == 0:  # it hosts the job store
            env = store_host_env(env)
        self.proc = subprocess.Popen(argv, env=env, pass_fds=fds, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, process_group=0, preexec_fn=preexec)
        self._reader = threading.Thread(target=self._read, name="job-link", daemon=True)
        self._reader.start()

    # ---------------------------------------------------------------- agent I/O
    def _send(self, cmd: str, attempt: int = -1, **fields: Any) -> None:
        """The command `cmd` (agent_messages.py declares its fields) to the agent."""
        line = encode(command(cmd, attempt=attempt, **fields))
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the agent is gone; the reader reports it

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = decode_event(line)  # decoded here once: typed from now on
            except Malformed as exc:
                logger.warning(f"node agent: {exc}")
                continue
            if isinstance(event, Aborted):
                self._record_abort(event.attempt, decode_cause(event.cause))  # the cause decoded once, here
            elif isinstance(event, Lost):
                self._set_lost(event.message)
            elif isinstance(event, MovedOut):
                self._moved_out(event)
            elif isinstance(event, Lines):
                if self._on_lines is not None:
                    self._on_lines(event.node, event.records)
            elif event.EVENT in self._listeners:
                self._listeners[event.EVENT](event)
            else:
                self._replies.put(event)
        self._set_lost(f"the node agent (job store link to {self.where}) exited")

    def _record_abort(self, attempt: int, heard: HeardCause) -> None:
        cause, delay = heard.cause, heard.stop_after_s
        with self._abort_seen:
            first = attempt not in self._aborts
            self._aborts.setdefault(attempt, cause)
            self._abort_seen.notify_all()
        if not first:
            return
        # A node named dead by its closed connection is the cause at once (`winner`), but this node's
        # workers are stopped a few seconds later: failing first on the dead node's connections, they
        # are recorded as its consequence instead of being cut short by the stop.
        if delay is not None and 0 < delay <= STOP_AFTER_MAX_S:
            timer = threading.Timer(delay, self._call_back, args=(attempt, cause))
            timer.daemon = True
            timer.start()
        else:
            self._call_back(attempt, cause)

    def _moved_out(self, event: MovedOut) -> None:
        """Node 0 moved this node out as a straggler (node_move_out.py): this node's end of the
        attempt, at once (its workers stopped, no restart: a spare node is this node now), never
        published to the job, which goes on without it."""
        if self.moved_out is None:
            self.moved_out = event.message
            self._record_abort(event.attempt, HeardCause(RootCause(
                CauseKind.STRAGGLER, ExitCode.OK, f"this node was moved out of the job by node 0, a spare node taking "
                f"its place: {event.message}")))

    def _call_back(self, attempt: int, cause: RootCause) -> None:
        with self._callbacks:
            callback = self._on_abort.get(attempt)
            if callback is not None:
                callback(cause)

    def _set_lost(self, message: str) -> None:
        if self.lost is None:
            self.lost = message
            with self._abort_seen:
                self._abort_seen.notify_all()
            self._replies.put(Lost(message=message))
            with self._callbacks:
                if self._on_lost is not None:
                    self._on_lost(message)

    def _reply(self, timeout: float | None) -> Event:
        try:
            event = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise NodeLinkError(f"the node agent did not answer within {timeout:g} s") from None
        if isinstance(event, Lost):
            raise NodeLinkError(event.message)
        return event

    def listen(self, kind: str, callback: Callable[[Any], None]) -> None:
        """Agent events of `kind` go to `callback` (the reader thread) instead of the replies;
        `command` sends what asks for them (regroup_link.py: a live recovery's control plane)."""
        self._listeners[kind] = callback

    def command(self, cmd: str, attempt: int, **fields: Any) -> None:
        self._send(cmd, attempt, **fields)

    # ---------------------------------------------------------------- per attempt
    def join(self, attempt: int, record: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
        """(the round joined, every admitted node's record in node-rank order). The round is the
        attempt itself, except in an elastic job a late node joins a later round of the others."""
        self._send("join", attempt, record=record)
        event = self._reply(self.join_timeout * 2 + self.last_call + 60)  # the agent's import + connect + wait
        while isinstance(event, Waiting):  # elastic: a round runs without this node; it joins the next one
            running = ", ".join(str(r) for r in event.members)
            logger.info(f"node {self.spec.node_rank}: the job is running on node(s) {running} (round "
                        f"{event.round}); this node waits to join at its next restart")
            event = self._reply(None)  # as long as that round runs; the agent says if the store goes
        if isinstance(event, Joined):
            return event.round, event.nodes
        if isinstance(event, JoinClosed):
            raise NodeLinkError(f"node {self.spec.node_rank}: the job on {self.where} ended before a restart "
                                "admitted this node (it never ran)")
        if isinstance(event, JoinAborted):
            cause = self.winner(event.attempt, timeout=0)
            raise NodeLinkError(cause.message, cause.exit_code, cause)
        if not isinstance(event, JoinTimedOut):
            raise NodeLinkError(f"node {self.spec.node_rank}: the node agent answered {event.EVENT!r} to a join")
        if event.unreachable:
            raise NodeLinkError(f"node {self.spec.node_rank}: node 0's job store at {self.where} did not answer "
                                f"within {self.join_timeout:g} s (is node 0 started, and --master-addr/--master-port "
                                f"right?): {event.detail}".rstrip(": "))
        missing = ", ".join(str(n) for n in event.missing)
        raise NodeLinkError(f"node(s) {missing} of {self.spec.nnodes} did not join within {self.join_timeout:g} s "
                            f"(system.rendezvous_timeout) at {self.where}")

    def stand_by(self, attempt: int, record: dict[str, Any]) -> Promoted:
        """A spare node (--spare-nodes): stand by in the job's rounds from `attempt` on, holding no
        rank, until node 0 hands this node a dead node's place: the `promoted` event (round,
        generation, node, claim, nodes). The job's end first: SpareNodeUnused."""
        self._send("stand-by", attempt, record=record)
        said = False
        while True:
            event = self._reply(None if said else self.join_timeout * 2 + 60)
            if isinstance(event, Promoted):
                return event
            if isinstance(event, StandingBy) and not said:
                said = True
                logger.info(f"spare node {self.spec.node_rank}: standing by in the job at {self.where} (round "
                            f"{event.attempt}, {len(event.nodes)} training node(s)): it takes the place of a "
                            "node that dies")
            elif isinstance(event, SpareClosed):
                raise SpareNodeUnused(f"spare node {self.spec.node_rank}: the job ended; this node was not needed")
            elif isinstance(event, SparePassedOver):  # it was frozen when node 0 needed it: it ends, exit 0
                raise SpareNodeUnused(event.message)
            elif isinstance(event, SpareRefused):  # its settings differ (2), or a value no node wrote (1)
                raise NodeLinkError(event.message, event.exit_code)
            elif isinstance(event, JoinAborted):  # its --node-rank is another node's
                cause = self.winner(event.attempt, timeout=0)
                raise NodeLinkError(cause.message, cause.exit_code, cause)

    def watch(self, attempt: int, on_abort: Callable[[RootCause], None], on_lost: Callable[[str], None]) -> None:
        """From now on, another node's failure (or the store's loss) calls back, from the reader thread."""
        with self._callbacks:
            self._on_abort[attempt] = on_abort
            self._on_lost = on_lost
        self._send("watch", attempt)
        with self._abort_seen:
            cause = self._aborts.get(attempt)
        if cause is not None:
            on_abort(cause)

    def unwatch(self) -> None:
        """The supervision these callbacks reach is over: no call after this returns."""
        with self._callbacks:
            self._on_abort.clear()
            self._on_lost = None

    def publish(self, attempt: int, cause: dict[str, Any]) -> None:
        """Offer this node's failure as the job's root cause (returns at once)."""
        self._send("abort", attempt, cause=cause)

    def winner(self, attempt: int, timeout: float = 3.0) -> RootCause | None:
        """The job's root cause for this attempt (after publish), or None if the store never said."""
        with self._abort_seen:
            self._abort_seen.wait_for(lambda: attempt in self._aborts or self.lost is not None, timeout)
            return self._aborts.get(attempt)

    def silent_nodes(self, attempt: int) -> list[RootCause]:
        """After a failure: the other nodes that stopped beating, each as a root cause ("node r
        (host) stopped responding"); [] when every other node is alive, done or gone. Takes
        about two seconds when all are alive (node 0's next readings of the beats), up to the
        agent's silent_s (system.node_silence_timeout) when one is not."""
        self._send("alive", attempt)
        try:
            event = self._reply(self.silent_s + SILENT_CHECK_S)
        except NodeLinkError:
            return []
        return [decode_cause(d).cause for d in event.silent] if isinstance(event, AliveChecked) else []

    def finished(self, attempt: int, wait_for_all: float | None) -> RootCause | None:
        """Say this node's workers finished. Node 0 (`wait_for_all` seconds) keeps the store up
        until every node has said so; returns the job's abort cause if one came instead."""
        self._send("done", attempt)
        if wait_for_all is None:
            return None
        self._send("wait-done", attempt, timeout=wait_for_all)
        event = self._reply(wait_for_all + 30)
        if not isinstance(event, Finished):
            raise NodeLinkError(f"the node agent answered {event.EVENT!r} to wait-done")
        if event.missing:
            missing = ", ".join(str(n) for n in event.missing)
            raise NodeLinkError(f"node(s) {missing} did not finish within {wait_for_all:g} s of node 0's workers",
                                ExitCode.HANG)
        with self._abort_seen:
            return self._aborts.get(attempt)

    def share_lines(self, records: list[dict[str, Any]]) -> None:
        """Console lines this node held for folding across nodes (supervisor/output/cross_node.py
        `Group.encode`), to node 0's folding point over the agents' direct connection."""
        self._send("lines", records=records)

    def receive_lines(self, callback: Callable[[int, list[Any]], None]) -> None:
        """Node 0: `callback(node, records)` from the reader thread for every node's lines (its own too)."""
        self._on_lines = callback

    def share_outcome(self, outcome: dict[str, Any]) -> None:
        """A node other than 0: how it ended, for node 0's summary."""
        self._send("outcome", outcome=outcome)

    def outcomes(self, timeout: float) -> list[tuple[int, dict[str, Any] | None]]:
        """Node 0: (node rank, outcome) of the other nodes of the last attempt (1..n-1, or an elastic
        round's), the outcome None for one that did not say within `timeout`."""
        self._send("outcomes", timeout=timeout)
        try:
            event = self._reply(timeout + 10)
        except NodeLinkError:
            event = None
        if not isinstance(event, Outcomes):
            return [(r, None) for r in range(1, self.spec.nnodes)]
        return list(zip(event.ranks, event.nodes or [None] * len(event.ranks), strict=True))

    def close(self, linger: float = 30.0) -> None:
        """Leave the job. Node 0 keeps the store up (at most `linger` s) until every other node
        has left, so none of them mistakes node 0's exit for a failure before reading the outcome."""
        if self.lost is None:
            if self.spec.node_rank == 0:
                self._send("linger", timeout=linger)
                try:
                    self._reply(linger + 10)
                except NodeLinkError:
                    pass
            else:
                self._send("leave")
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=5)
        self._log.close()
