"""One live recovery as summary.json, metrics.jsonl and `gpuherd report` show it, and its line
on the console once it is over (live_recovery.py records it; live_policy.py decides it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from gpuherd.status_records import NODE_MOVED_OUT
from supervisor.processes.spawn import WorkerProcess


@dataclass
class Recovery:
    """One live recovery, as summary.json and `gpuherd report` show it."""

    number: int  # 1, 2, ... in this run
    attempt: int
    rank: int
    device: str
    failed: str  # what happened to the lost rank (the cause's message)
    kind: str  # worker-exit | hang | straggler | regrow (a warm spare took back a carried rank: nothing failed)
    #            | node (a node died whole) | node-straggler (a straggler node moved out: NODE_MOVED_OUT)
    lost_pid: int
    replaced_by_pid: int
    survivors: list[dict[str, int]]  # [{"rank", "pid"}]: the ranks that kept their processes
    started_at: str
    outcome: str = "in progress"  # recovered | failed (a second failure: restarted from a checkpoint)
    resumed_step: int | None = None  # completed steps the rebuilt group continued from
    source_rank: int | None = None  # the survivor whose state the newcomer took
    steps_redone: int | None = None  # completed steps trained again (the step in flight is redone too)
    seconds: float | None = None  # death -> the newcomer's first completed step
    rejoin_s: float | None = None  # the newcomer's own join + state transfer
    checkpoint_reads: int = 0
    node: int | None = None  # multi-node: the node whose rank was lost (it promoted its own spare)
    action: str = "replaced"  # replaced (by a warm spare) | shrink (the survivors went on without it) | regrow
    #                           | spare-node (a node died whole: a spare node took its ranks)
    spare_node: int | None = None  # spare-node: the --node-rank of the spare node that took the dead node's place
    replicas: int | None = None  # shrink, regrow: the processes training on (after a shrink one carries the lost slot)
    # shrink: from the loss to its regrow, or to the attempt's end; regrow: the same span (the rank's slot carried)
    shrunk_s: float | None = None
    straggler: dict[str, Any] | None = None  # a straggler moved out: the evidence (health/straggler_moves.py)
    _died: float = field(default=0.0, repr=False)
    _reached: int = field(default=0, repr=False)  # the most completed steps any rank reported before
    _generation: int = field(default=1, repr=False)  # the rebuilt group of this attempt it forms
    _remote: bool = field(default=False, repr=False)  # another node's rank: this node's survivors end it

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}

    def line(self) -> str:
        survivors = ", ".join(f"rank {s['rank']} pid {s['pid']}" for s in self.survivors) or "none on this node"
        where = f"node {self.node}'s " if self.node is not None else ""
        if self.outcome != "recovered":
            return f"live recovery {self.number}: {where}rank {self.rank} ({self.device}) {self.outcome}: {self.failed}"
        if self.action == "regrow":
            return (f"live recovery {self.number}: regrow: {where}warm spare pid {self.replaced_by_pid} took back rank "
                    f"{self.rank} ({self.device}) after {self.shrunk_s:.1f} s shrunk: {self.replicas} process(es) "
                    f"train again, its data slot no longer carried; {self.seconds:.2f} s from the decision to its "
                    f"first completed step, joined at step {self.resumed_step} from rank {self.source_rank}, "
                    f"{self.steps_redone} completed step(s) redone, no checkpoint read; kept their processes: "
                    f"{survivors}")
        if self.action == "shrink" and self.kind == "node":
            return (f"live recovery {self.number}: node {self.node} died whole with no spare node left: "
                    f"{self.replicas} process(es) on the other nodes train on with its ranks' data slots carried "
                    f"(same global batch and data order) after {self.seconds:.2f} s (loss -> next completed step), "
                    f"resumed at step {self.resumed_step} from rank {self.source_rank}, {self.steps_redone} completed "
                    f"step(s) redone, no checkpoint read; kept their processes: {survivors}")
        if self.action == "shrink":
            return (f"live recovery {self.number}: {where}rank {self.rank} ({self.device}, pid {self.lost_pid}) lost "
                    f"with no spare left: {self.replicas} process(es) train on with its data slot carried (same global "
                    f"batch and data order) after {self.seconds:.2f} s (loss -> next completed step), resumed at "
                    f"step {self.resumed_step} from rank {self.source_rank}, {self.steps_redone} completed step(s) "
                    f"redone, no checkpoint read; kept their processes: {survivors}")
        if self.action == "spare-node":
            gone = "was moved out as a straggler" if self.kind == NODE_MOVED_OUT else "died whole"
            return (f"live recovery {self.number}: node {self.node} {gone}; spare node {self.spare_node} took its "
                    f"ranks (from rank {self.rank}) in {self.seconds:.2f} s (loss -> next completed step), resumed at "
                    f"step {self.resumed_step} from rank {self.source_rank}, {self.steps_redone} completed step(s) "
                    f"redone, no checkpoint read; kept their processes: {survivors}")
        how = (f"that node's spare pid {self.replaced_by_pid}; this node's ranks rebuilt the group with it"
               if self._remote else f"spare pid {self.replaced_by_pid}")
        return (f"live recovery {self.number}: {where}rank {self.rank} ({self.device}, pid {self.lost_pid}) "
                f"replaced by {how} in {self.seconds:.2f} s (loss -> next completed step), resumed at step "
                f"{self.resumed_step} from rank {self.source_rank}, {self.steps_redone} completed step(s) redone, "
                "no checkpoint read; "
                f"kept their processes: {survivors}")


def ranks_and_pids(workers: list[WorkerProcess]) -> list[dict[str, int]]:
    return [{"rank": w.slot.rank, "pid": w.pid} for w in sorted(workers, key=lambda w: w.slot.rank)]


def begun(rec: Recovery, ranks: tuple[int, ...], survivors: int, multi: bool, lost: list[Any],
          spare_host: str = "?", newcomers: tuple[int, ...] = ()) -> str:
    """The line that says a recovery begins (`ranks`: a shrink's or a regrow's group; `survivors`:
    this node's workers that keep running; `multi`: a multi-node job; `lost`: a node's lost ranks
    as claimed; `newcomers`: the pids of this spare node's workers that take them)."""
    keep = f"this node's {survivors} worker(s) keep running"
    if rec.action == "regrow":
        if rec._remote:
            return (f"node {rec.node}: live recovery {rec.number}: its warm spare pid {rec.replaced_by_pid} takes back "
                    f"rank {rec.rank}: this node's {survivors} worker(s) rebuild the group with it at their next step "
                    f"boundary ({len(ranks)} process(es))")
        return (f"live recovery {rec.number}: warm spare pid {rec.replaced_by_pid} takes back rank {rec.rank} "
                f"({rec.device}), whose data slot was carried for {rec.shrunk_s:.1f} s: the {survivors} "
                f"worker(s){' of this node and every other node' if multi else ''} rebuild the group "
                f"with it at their next step boundary ({len(ranks)} process(es))")
    if rec.action == "shrink":
        return _shrunk(rec, ranks, survivors, multi, lost, keep)
    if rec.action == "spare-node" and not rec._remote:
        return (f"{rec.failed}: live recovery {rec.number}: this spare node takes node {rec.node}'s ranks "
                f"{', '.join(str(r) for r in lost)} (pid(s) {', '.join(str(p) for p in newcomers)}); every other "
                "node's workers keep running")
    if rec.action == "spare-node":
        return (f"{rec.failed}: live recovery {rec.number}: spare node {rec.spare_node} ({spare_host}) takes its "
                f"ranks {lost}; {keep} and rebuild the group with it")
    if rec._remote:
        return (f"node {rec.node}: {rec.failed}: live recovery {rec.number}: its warm spare pid "
                f"{rec.replaced_by_pid} takes rank {rec.rank}; {keep} and rebuild the group with it")
    others = f"the other {survivors} worker(s)" if not multi else \
        f"every other node's workers and this node's {survivors} other worker(s)"
    return (f"{rec.failed}: live recovery {rec.number}: warm spare pid {rec.replaced_by_pid} takes rank "
            f"{rec.rank}; {others} keep running and rebuild the group with it")


def _shrunk(rec: Recovery, ranks: tuple[int, ...], survivors: int, multi: bool, lost: list[Any], keep: str) -> str:
    without = f"rank {rec.rank}, one of them carrying its data slot"
    if not rec._remote:
        said = (f"{rec.failed}: live recovery {rec.number}: no warm spare left: the other {len(ranks)} "
                f"worker(s){' of the job' if multi else ''} keep running")
    elif rec.kind == "node":  # node 0 found the whole node dead, and no spare node free (node_shrink_agent.py)
        said = f"{rec.failed}: live recovery {rec.number}: no spare node left: {keep}"
        without = (f"node {rec.node}'s rank(s) {', '.join(str(r) for r in lost)} (it cannot come back before a "
                   "restart), the survivors carrying their data slots")
    else:
        said = f"node {rec.node}: {rec.failed}: live recovery {rec.number}: no warm spare left there: {keep}"
    lead = f"; rank {ranks[0]} leads in its place (checkpoints, the run's scalars)" if rec.rank < ranks[0] else ""
    return f"{said} and go on without {without} (same global batch and data order; --min-replicas){lead}"
