"""The multi-node backend: the node joins the job through its agent (job_link.py), gets
its global ranks, node 0 hosts the attempt's worker store on the chosen interface, and
root causes travel through the job store both ways: the first failure any node
publishes is every node's root cause.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from gpuherd.config import Config
from gpuherd.exit_codes import ExitCode
from supervisor.gpus import DevicePlan
from supervisor.rendezvous.agent_messages import MoveNodeOut, NodeMoveAnswer
from supervisor.rendezvous.api import OnCause, OnRemote, Setup
from supervisor.rendezvous.job_link import JobLink
from supervisor.rendezvous.nodes import NodeLinkError, NodeSpec, layout, training_fingerprint
from supervisor.rendezvous.regroup_link import RegroupLink
from supervisor.rendezvous.store import HostedStore
from supervisor.summary import CauseKind, RootCause

OUTCOME_WAIT_S = 10.0  # node 0's wait for the other nodes' outcomes (each sends it as it ends)


class MultiNode:
    def __init__(self, spec: NodeSpec, cfg: Config, mode: str, run_id: str, run_dir: Path, bind_ip: str | None,
                 listen: socket.socket | None, env: dict[str, str], preexec: Callable[[], None],
                 finish_wait: float, run_id_given: bool = True) -> None:
        """`run_id_given`: the id was typed (--run-id, or SLURM's job id), not generated on this node."""
        self.spec, self.cfg, self.mode = spec, cfg, mode
        self.node_rank, self.nnodes = spec.node_rank, spec.nnodes  # nnodes: the nodes of the attempt running
        self.group_rank = spec.node_rank  # this node's place among them (GROUP_RANK)
        self._rounds: dict[int, int] = {}  # this node's attempt -> the job's round (elastic: a late node's differ)
        self.host = socket.gethostname()
        self.bind_ip = bind_ip
        self.finish_wait = finish_wait  # node 0: how long it keeps the store up for nodes still finishing
        self.record = {"host": self.host, "fingerprint": training_fingerprint(cfg), "mode": mode,
                       "run_id": run_id, "run_id_given": run_id_given, "run_dir": str(run_dir),
                       "spare_nodes": cfg.system.spare_nodes, "min_replicas": cfg.system.min_replicas}
        self.spare = spec.node_rank >= spec.nnodes  # a spare node (--spare-nodes) until it takes a dead node's place
        self.nodes: list[dict] = []
        self.link = JobLink(spec, cfg.system.rendezvous_timeout, sys.executable, env, preexec,
                            run_dir / "node-agent.log", listen, last_call=cfg.system.rendezvous_last_call,
                            silent_s=cfg.system.node_silence_timeout)
        self.helper_pid: int | None = self.link.proc.pid  # the agent lives for the whole job

    def begin(self, attempt: int, plan: DevicePlan, resume: str | None) -> Setup:
        store = HostedStore(bind_addr=self.bind_ip) if self.node_rank == 0 else None
        record = {**self.record, "node": self.node_rank, "nproc": plan.world_size}
        if self.spare:
            return self._stand_by(attempt, plan, record)
        if store is not None:
            record.update(worker_port=store.port, resume=resume)
        try:
            self._rounds[attempt], nodes = self.link.join(self._round(attempt - 1) + 1 if attempt else 0, record)
            self.group_rank = [n.get("node", r) for r, n in enumerate(nodes)].index(self.node_rank)
            lay = layout(nodes, self.group_rank)
        except NodeLinkError:
            if store is not None:
                store.stop()
            raise
        self.nnodes = len(nodes)
        self._place(nodes)
        return Setup(plan.with_rank_offset(lay.rank_offset), self.spec.master_addr, int(nodes[0]["worker_port"]),
                     lay.world_size, nodes[0].get("resume"), store)

    def _stand_by(self, attempt: int, plan: DevicePlan, record: dict) -> Setup:
        """A spare node: no rank until node 0 hands it a dead node's place (spare_node_agent.py);
        from then on it is that node, for this attempt and every later one."""
        promotion = self.link.stand_by(self._round(attempt - 1) + 1 if attempt else 0, record)
        nodes, r = promotion.nodes, promotion.node
        self.spare, self.node_rank, self.group_rank = False, r, r
        self._rounds[attempt] = promotion.attempt
        lay = layout(nodes, r)
        self.nnodes = len(nodes)
        self._place(nodes)
        return Setup(plan.with_rank_offset(lay.rank_offset), self.spec.master_addr, int(nodes[0]["worker_port"]),
                     lay.world_size, nodes[0].get("resume"), None, join_generation=promotion.generation,
                     promotion=promotion.claim)

    def _place(self, nodes: list[dict]) -> None:
        self.nodes = [{"node": n.get("node", r), "first_rank": sum(m["nproc"] for m in nodes[:r]),
                       **{k: n[k] for k in ("host", "nproc", "run_id", "run_dir")}} for r, n in enumerate(nodes)]

    def _round(self, attempt: int) -> int:
        """The job's round this node's attempt ran in (the same number unless this node came late)."""
        return self._rounds.get(attempt, attempt)

    def _as_job_cause(self, cause: RootCause) -> dict:
        d = dataclasses.asdict(cause)
        d.update(node=self.node_rank, host=self.host)
        if not cause.slurm_stop:  # SLURM stopped every node: no node to name
            d["message"] = f"node {self.node_rank} ({self.host}): {cause.message}"
        return d

    def publisher(self, attempt: int) -> OnCause:
        return lambda cause: self.link.publish(self._round(attempt), self._as_job_cause(cause))

    def watch(self, attempt: int, on_remote: OnRemote) -> None:
        self.link.watch(self._round(attempt), on_abort=lambda cause: on_remote(cause, cause.node == self.node_rank),
                        on_lost=lambda message: on_remote(RootCause("node", ExitCode.FAILURE, message, node=0)))

    def unwatch(self) -> None:
        self.link.unwatch()

    def regroup(self, attempt: int) -> RegroupLink:
        return RegroupLink(self.link, self._round(attempt), self.node_rank)

    def mover(self, attempt: int, answer: Callable[[int, str | None], None]) -> Callable[[int, str], None] | None:
        """Node 0: how a straggler node is moved out in this attempt (node_move_out.py): called with
        the node and the verdict; `answer(node, why_not)` comes back from the agent (any thread)."""
        if self.node_rank != 0:
            return None
        self.link.listen(NodeMoveAnswer.EVENT, lambda event: answer(event.node, event.why_not))
        k = self._round(attempt)
        return lambda node, message: self.link.command(MoveNodeOut.CMD, k, node=node, message=message)

    def lines(self, receive: Callable[[int, list], None]) -> Callable[[list], None]:
        self.link.receive_lines(receive)
        return self.link.share_lines

    def fail_before_start(self, cause: RootCause) -> RootCause:
        """This node cannot even join (its dataset failed): tell the others, who are waiting
        to join, so they stop with this cause instead of a join timeout. In an elastic job only
        node 0 is waited for: another node failing here leaves the job to the nodes that came."""
        if self.spec.elastic and self.node_rank != 0:
            return cause
        self.link.publish(0, self._as_job_cause(cause))
        winner = self.link.winner(0, timeout=min(self.cfg.system.rendezvous_timeout, 30.0) + 10)
        return winner if winner is not None else cause

    def settle(self, attempt: int, cause: RootCause | None, notes: list[str]) -> RootCause | None:
        """Every node ends the attempt with the same root cause: the first one published."""
        attempt = self._round(attempt)
        if self.link.moved_out is not None and cause is not None and cause.kind == CauseKind.STRAGGLER:
            notes.append(cause.message)  # node 0 moved it out: its part ended as asked, the job goes on
            return None
        if cause is None:
            try:
                remote = self.link.finished(attempt, self.finish_wait if self.node_rank == 0 else None)
            except NodeLinkError as exc:
                return RootCause("node", exc.exit_code, str(exc), node=self.node_rank, host=self.host)
            return remote
        if cause.kind == CauseKind.MEMBERSHIP:  # node 0's agent published it for every node: nobody's failure
            return cause
        ours = RootCause.from_dict(self._as_job_cause(cause)) if cause.node is None else cause
        winner = self.link.winner(attempt) or ours
        asked = (CauseKind.TERMINATED, CauseKind.INTERRUPTED)  # a stop every node was asked for: one event, not two
        if winner.message != ours.message and not (winner.kind in asked and cause.kind in asked):
            # A failure here after another node was found dead broke on that node's closed connections.
            dead = winner.kind == CauseKind.NODE and winner.node != self.node_rank
            notes.append(f"a consequence of that, not the cause: {ours.message}" if dead
                         else f"also on this node, after the job's first failure: {cause.message}")
        if winner.node == self.node_rank and cause.node is None:
            winner = dataclasses.replace(winner, stderr_tail=cause.stderr_tail)  # complete now every pipe is drained
        return self._blame_dead_node(attempt, winner, notes)

    def _blame_dead_node(self, attempt: int, cause: RootCause, notes: list[str]) -> RootCause:
        """A worker failure in the moment another node died (its workers' connections closed)
        is that death's consequence: the dead node is the job's cause on every survivor. So is
        a stop signal then (srun's --kill-on-bad-exit, SLURM ending the step of a lost node),
        and, on a node that lost the job store meanwhile, a hang across the cut."""
        if cause.kind in (CauseKind.NODE, CauseKind.STORE, CauseKind.INTERRUPTED, CauseKind.MEMBERSHIP):
            return cause
        silent = [d for d in self.link.silent_nodes(attempt) if d.node != cause.node]
        if silent:
            notes.append(f"a consequence of that, not the cause: {cause.message}")
            return silent[0]
        if self.link.lost is not None and self.node_rank != 0:
            # Cut off from node 0 (its machine, or the network): the workers' collectives across
            # that cut stall or break before the store call notices, so the hang or broken
            # connection this node saw first is the cut's consequence, and the cut is named.
            notes.append(f"a consequence of that, not the cause: {cause.message}")
            return RootCause("node", ExitCode.FAILURE, self.link.lost, node=0)
        return cause

    def gather_outcomes(self, mine: dict) -> list[dict] | None:
        """Node 0 prints the job's summary with every node's outcome; the others hand theirs
        over (a node cut off from the store prints its own)."""
        if self.link.lost is not None:
            return [mine]
        if self.node_rank != 0:
            self.link.share_outcome(mine)
            return None
        others = self.link.outcomes(OUTCOME_WAIT_S)
        return [mine, *[o or {"node": r, "outcome": "unknown: it never said"} for r, o in others]]

    def close(self) -> None:
        self.link.close()
