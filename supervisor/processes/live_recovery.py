"""Live recovery, the supervisor's side: a lost rank is replaced by a warm spare while the
other workers keep their processes (worker/live_recovery.py is the ranks' side).

When a rank dies (an exit, a signal, or a SIGKILL after a hang verdict), the supervision
policy (policy.py) decides from `why_not` whether a spare takes it; `replace()` then either
promotes a spare to its rank (the survivors notice the closed connections in their next
collective and rebuild the group with it) or says in one line why live recovery cannot
apply, and the supervision tears down as before: a restart from the last checkpoint.
Each recovery is accounted for (`recoveries`: summary.json, metrics.jsonl, the console)
and uses one of --max-restarts. The pool refills the moment a spare is promoted (while a
restart is left for another recovery), so --spares K spares stand by after every recovery.

Its clock runs from the death to the newcomer's first completed step (`first_step` record);
steps redone are the completed steps any rank reported beyond the step the group resumed at.

In a multi-node job (`regroup`: the job's control plane, supervisor/rendezvous/regroup_link.py)
the node that lost a rank claims rebuilt group g before it promotes its own spare (first
claim wins: a node losing a rank in the same instant falls back to the job-wide restart), and
every other node hears of the claim (`heard`): it records the same recovery (numbered alike,
counted against --max-restarts alike, its own ranks as the survivors), watches its own
survivors leave the broken group (`stuck`), and ends it at their first completed step.

With --min-replicas N, a loss with no warm spare left shrinks the group instead
(`shrinks`, `shrink`): the decision goes into the workers' store (contract.DECISION_KEY,
which the survivors read before they rebuild the group; a spare's promotion is written there
too), the survivors rebuild it without the lost rank and one of them carries its data slot
(worker/data_slots.py), so the global batch and the data order stay the same. The pool then
starts its spares again (--spares K); once one says it is warm, the loop asks the policy
(`regrow_candidate`, policy.py's `SpareReady`), and `regrow` hands it a carried rank: the
decision goes into the store as for a shrink (`{"regrow": r, "ranks": [...]}`), the group's
first rank reads it at its next step boundary and every rank rebuilds the group with the
newcomer there; the carrier drops the slot. A regrow uses no --max-restarts (nothing failed).
A later loss while shrunk shrinks again (or restarts).

Across nodes the shrink and the regrow are claimed like a replacement (the claim carries the
decision: `action`, `decision`), the group's ranks are the job's (`members`), and node 0, whose
helper hosts the workers' store, writes every node's decision there (`heard`); every node
records both. A shrink that would leave the losing node with no rank of its own restarts
instead: a node's supervision ends with its last worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import orjson
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from loguru import logger

from gpuherd import contract
from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Done, LiveAble, LiveFirstStep, LiveLostPeer, LiveRejoined, Record, Step

from supervisor.gpus import DeviceSlot
from supervisor.processes.spares import SparePool
from supervisor.processes.spawn import WorkerProcess
from supervisor.summary import RootCause, now_iso

STUCK_S = 10.0  # after a loss, every survivor has left the broken group's collective by then, or never will


class Regroup(Protocol):
    """A multi-node job's control plane for live recovery (supervisor/rendezvous/regroup_link.py)."""

    def claim(self, generation: int, claim: dict[str, Any]) -> str | None:
        """None: rebuilt group `generation` is this node's to form; else why not."""

    def follow(self, on_claim: Callable[[int, dict[str, Any] | None], None]) -> None:
        """Every node's claims of this attempt from now on, to `on_claim` (any thread)."""

    def stop(self) -> None:
        """No call of `on_claim` after this returns."""


@dataclass
class Recovery:
    """One live recovery, as summary.json and `gpuherd report` show it."""

    number: int  # 1, 2, ... in this run
    attempt: int
    rank: int
    device: str
    failed: str  # what happened to the lost rank (the cause's message)
    kind: str  # worker-exit | hang | straggler | regrow (a warm spare took back a carried rank: nothing failed)
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
            return (f"live recovery {self.number}: node {self.node} died whole; spare node {self.spare_node} took its "
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


class LiveRecovery:
    def __init__(self, pool: SparePool, budget: int, attempt: int, env_for: Callable[[DeviceSlot, WorkerProcess, int],
                 Mapping[str, str]], numbered_from: int, write_metric: Callable[[dict], None],
                 off: str | None = None, regroup: Regroup | None = None, node: int | None = None,
                 shrink_floor: int = 0, tell: Callable[[str, str], bool] | None = None,
                 worker_env: Mapping[str, str] | None = None, world_size: int = 0, script: bool = False,
                 lazy_spares: bool = False) -> None:
        """`budget`: recoveries allowed (what --max-restarts leaves); `env_for(slot, spare)`: the lost
        rank's environment for the spare, joining rebuilt group n; `off`: why live recovery is off for
        the whole attempt; `regroup`, `node`: a multi-node job's control plane, and this node's rank;
        `shrink_floor`: --min-replicas (0: never shrink); `tell(key, value)`: a key into the workers'
        store (multi-node: node 0's, None elsewhere); `worker_env`: what every worker of the attempt
        gets in its environment; `world_size`: the job's ranks (multi-node: every node's); `script`: the
        ranks run a user's script, recovered live through gpuherd.live; `lazy_spares`: the pool's first
        spares start once a rank says it can be recovered live, not with the attempt (a script whose
        file does not name gpuherd.live: one that never attaches keeps no spare)."""
        self.pool, self.budget, self.attempt, self.env_for = pool, budget, attempt, env_for
        self.off, self.numbered_from, self.write_metric = off, numbered_from, write_metric
        self.regroup, self.node = regroup, node
        self.shrink_floor, self.tell = shrink_floor, tell
        self.worker_env = dict(worker_env or {contract.LIVE_RECOVERY: "1"})
        self.world_size = world_size
        self.script, self.lazy_spares = script, lazy_spares
        self.group: list[int] | None = None  # shrunk: the ranks training on, job-wide (a regrow adds one back)
        self.shrunk_since: dict[int, Recovery] = {}  # a rank whose data slot is carried -> the shrink that lost it
        self.asked: dict[int, int] = {}  # a spare an operator asked for (`gpuherd spare`): its pid -> the rank it takes
        self.finished = False  # a rank said `done`: training is over, no regrow any more
        self.able: dict[int, str | None] = {}  # rank -> None (can be recovered live) or why not
        self.no_shrink: dict[int, str] = {}  # rank -> why the group cannot go on without it (fsdp's shards)
        self.completed: dict[int, int] = {}  # rank -> completed steps it reported
        self.recoveries: list[Recovery] = []
        self.joined_at = 0  # a spare node that took a dead node's place: the rebuilt group it joined
        # rebuilt group -> {survivor rank: completed steps}: its `lost_peer` records, which may come
        # before the supervisor has even reaped the lost rank
        self.left: dict[int, dict[int, int]] = {}
        # rebuilt group -> {survivor rank: its `rejoined` record}: in a multi-node job a survivor may
        # rejoin before the supervisor has heard of another node's claim
        self.rejoined: dict[int, dict[int, LiveRejoined]] = {}

    @property
    def next_generation(self) -> int:
        """The rebuilt group the next recovery forms (a spare node's first attempt joined the
        job's at `joined_at`: the groups before were formed without it)."""
        return self.joined_at + len(self.recoveries) + 1 - (1 if self.joined_at else 0)

    @property
    def in_flight(self) -> Recovery | None:
        last = self.recoveries[-1] if self.recoveries else None
        return last if last is not None and last.outcome == "in progress" else None

    def why_not(self, rank: int, survivors: list[int], suspect_gpu: bool = False) -> str | None:
        """None when a spare can take `rank` now; else the reason, in words for the user.
        `suspect_gpu`: the rank left over its own GPU (exit 8): a spare promoted into its slot would
        train on that same GPU, so only a shrink can go on without it."""
        if self.off:
            return self.off
        if self.in_flight is not None:
            return f"a second failure during a recovery (rank {self.in_flight.rank} was being replaced)"
        if self.budget <= 0:
            return "no restart left for it (--max-restarts counts recoveries and restarts alike)"
        if not survivors and self.regroup is None:  # multi-node: the other nodes' ranks survive
            return "every rank was lost: no survivor holds the state"
        for r in [rank, *survivors]:
            if r not in self.able and self.script:
                return (f"rank {r}'s script had not called gpuherd.live.attach (a script is recovered live only "
                        "through it)")
            if r not in self.able:
                return f"rank {r} had not started training yet (no state to hand over)"
            if self.able[r] is not None:
                return f"rank {r}: {self.able[r]}"
        if self.shrinks(suspect_gpu):
            return self.why_not_shrink(rank, survivors)
        if suspect_gpu:
            return (f"rank {rank}'s GPU is a suspect device and a warm spare takes a rank on the rank's own GPU "
                    "(a spare on another GPU is not built; --min-replicas would go on without it)")
        return None

    def shrinks(self, suspect_gpu: bool = False) -> bool:
        """A loss now shrinks the group: --min-replicas, and no warm spare (or shrunk already, or
        the lost rank's GPU is suspect: a spare would run on it)."""
        return self.shrink_floor > 0 and (self.group is not None or suspect_gpu or not self.pool.ready())

    def why_not_shrink(self, rank: int, survivors: list[int]) -> str | None:
        """Rank 0 may be the one lost: the shrunk group's first rank (its lowest survivor) takes over
        what rank 0 did for the group (the checkpoints, the run's scalars) until a regrow brings
        rank 0 back (worker/train.py: `on_place`). Multi-node: `survivors` are this node's, the
        floor counts the job's."""
        job = [r for r in self.members() if r != rank] if self.regroup is not None else survivors
        if len(job) < self.shrink_floor:
            return (f"no spare left, and {len(job)} survivor(s) are fewer than --min-replicas "
                    f"{self.shrink_floor}")
        if rank in self.no_shrink:
            return f"no spare left, and rank {rank}: {self.no_shrink[rank]}"
        if not survivors:
            return (f"no spare left on this node (node {self.node}), and rank {rank} was its last training rank: "
                    "a node's supervisor ends with its last worker (a node left empty is not built)")
        return None

    def members(self) -> list[int]:
        """The ranks training now, job-wide: the shrunk group's, else every rank of the job."""
        return list(self.group) if self.group is not None else list(range(self.world_size))

    def _claim(self, generation: int, action: str, decision: dict[str, Any], claim: dict[str, Any]) -> str | None:
        """Multi-node: rebuilt group `generation` claimed on the job store, the decision with it (the
        workers' store is node 0's: node 0 writes it there when it hears the claim); None: claimed
        (or one node: nothing to claim)."""
        if self.regroup is None:
            return None
        return self.regroup.claim(generation, {**claim, "action": action, "decision": decision})

    def _agree(self, generation: int, action: str, decision: dict[str, Any], claim: dict[str, Any]) -> str | None:
        """A shrink or a regrow: claimed (multi-node), then into the workers' store where this node
        hosts it; None: done, else why not."""
        why = self._claim(generation, action, decision, claim)
        if why is None and not self._decide(generation, decision) and (self.regroup is None or self.tell is not None):
            why = "the rendezvous store is gone, so the workers cannot be told"
        return why

    def shrink(self, lost: WorkerProcess, cause: RootCause, survivors: list[WorkerProcess], now: float) -> bool:
        """No spare left: the survivors rebuild the group without `lost`, one of them carrying its
        data slot. False (said why): the decision could not reach them."""
        generation = self.next_generation
        ranks = sorted(w.slot.rank for w in survivors) if self.regroup is None else \
            [r for r in self.members() if r != lost.slot.rank]
        decision = {"shrink": lost.slot.rank, "ranks": ranks}
        why = self._agree(generation, "shrink", decision, {
            "rank": lost.slot.rank, "device": lost.slot.tag, "failed": cause.message, "kind": cause.kind,
            "lost_pid": lost.pid, "replaced_by_pid": 0, "died_at": _wall(now)})
        if why is not None:
            self._fail_in_flight(cause)
            logger.warning(f"live recovery not possible: {why}")
            return False
        self.budget -= 1
        started = self.pool.fill()  # a regrow's spare, warming up at a low priority (--spares K)
        if started:
            logger.info(f"new warm spare(s) pid {', '.join(str(s.pid) for s in started)} started in the background: "
                        "the group grows back once one is warm")
        rec = Recovery(number=self.numbered_from + len(self.recoveries) + 1, attempt=self.attempt, rank=lost.slot.rank,
                       device=lost.slot.tag, failed=cause.message, kind=cause.kind, lost_pid=lost.pid,
                       replaced_by_pid=0, survivors=_ranks_and_pids(survivors), started_at=now_iso(),
                       action="shrink", replicas=len(ranks), _died=now, node=self.node,
                       _reached=max(self.completed.values(), default=0), _generation=generation)
        self._shrunk(rec, ranks, f"{cause.message}: live recovery {rec.number}: no warm spare left: the other "
                                 f"{len(ranks)} worker(s){' of the job' if self.regroup else ''} keep running")
        return True

    def _shrunk(self, rec: Recovery, ranks: list[int], said: str, without: str | None = None) -> None:
        self.recoveries.append(rec)
        self.shrunk_since[rec.rank] = rec
        self.group = ranks
        lead = f"; rank {ranks[0]} leads in its place (checkpoints, the run's scalars)" if rec.rank < ranks[0] else ""
        without = without or f"rank {rec.rank}, one of them carrying its data slot"
        logger.warning(f"{said} and go on without {without} (same global batch and data order; --min-replicas)"
                       f"{lead}")

    def _decide(self, generation: int, decision: dict[str, Any]) -> bool:
        """The supervisor's word on rebuilt group `generation`, into the workers' store
        (contract.DECISION_KEY); False: there is no store to tell, or it is gone."""
        return self.tell is not None and bool(self.tell(contract.DECISION_KEY.format(generation=generation),
                                                        orjson.dumps(decision).decode()))

    def regrow_candidate(self) -> int | None:
        """The carried rank a warm spare can take back now (the one an operator asked it for, else the
        lowest), or None: the group is not shrunk, a recovery is in flight, a rank finished training
        (`done`), or no spare is warm yet."""
        carried = self.carried()
        spare = self.pool.warm() if carried and self.in_flight is None and not self.finished else None
        if spare is None:
            return None
        asked = self.asked.get(spare.pid)  # the operator named the rank's device
        return asked if asked in carried else min(carried)

    def carried(self) -> list[int]:
        """This node's ranks whose data slots are carried (another node's are that node's to take back)."""
        return sorted(rank for rank, rec in self.shrunk_since.items() if not rec._remote)

    def carried_elsewhere(self) -> dict[int, int]:
        """Multi-node: another node's carried rank -> that node (its own spares take it back)."""
        return {rank: rec.node for rank, rec in self.shrunk_since.items()
                if rec._remote and rec.node is not None and rec.kind != "node"}

    def dead_nodes(self) -> tuple[int, ...]:
        """Multi-node: the nodes that died whole and the job went on without (their ranks stay carried)."""
        return tuple(sorted(rec.node for rec in self.shrunk_since.values() if rec.kind == "node"
                            and rec.node is not None))

    def ask_spare(self, rank: int) -> WorkerProcess:
        """One warm spare more for carried rank `rank` (`gpuherd spare`): it takes the rank back once warm."""
        spare = self.pool.add()
        self.asked[spare.pid] = rank
        return spare

    def regrow(self, slot: DeviceSlot, log_path: Any, survivors: list[WorkerProcess],
               now: float) -> WorkerProcess | None:
        """A warm spare takes back carried rank `slot.rank`; the group rebuilds with it at its next
        step boundary. None (said why): the decision could not reach the workers."""
        spare = self.pool.take_warm()
        shrink = self.shrunk_since.get(slot.rank)
        if spare is None or shrink is None:
            return None
        generation = self.next_generation
        ranks = sorted([*(self.group or []), slot.rank])
        decision = {"regrow": slot.rank, "ranks": ranks}
        why = self._agree(generation, "regrow", decision, {
            "rank": slot.rank, "device": slot.tag, "failed": "", "kind": "regrow", "lost_pid": 0,
            "replaced_by_pid": spare.pid, "died_at": _wall(now)})
        if why is not None:
            self.pool.put_back(spare)
            logger.warning(f"regrow not possible: {why} (warm spare pid {spare.pid} was to take back rank "
                           f"{slot.rank})")
            return None
        new = self.pool.promote(spare, slot, log_path, self.env_for(slot, spare, generation))
        rec = self._grown(slot.rank, slot.tag, new.pid, ranks, survivors, now, generation)
        logger.info(f"live recovery {rec.number}: warm spare pid {new.pid} takes back rank {rec.rank} "
                    f"({rec.device}), whose data slot was carried for {rec.shrunk_s:.1f} s: the {len(survivors)} "
                    f"worker(s){' of this node and every other node' if self.regroup else ''} rebuild the group "
                    f"with it at their next step boundary ({len(ranks)} process(es))")
        return new

    def _grown(self, rank: int, device: str, pid: int, ranks: list[int], survivors: list[WorkerProcess],
               now: float, generation: int, node: int | None = None, remote: bool = False) -> Recovery:
        """Carried rank `rank` is trained by its own process `pid` again: the regrow, recorded."""
        shrink = self.shrunk_since.pop(rank)
        shrink.shrunk_s = round(now - shrink._died, 3)
        self.group = ranks if self.shrunk_since else None
        rec = Recovery(number=self.numbered_from + len(self.recoveries) + 1, attempt=self.attempt, rank=rank,
                       device=device, failed="", kind="regrow", lost_pid=0, replaced_by_pid=pid,
                       survivors=_ranks_and_pids(survivors), started_at=now_iso(), action="regrow",
                       replicas=len(ranks), shrunk_s=shrink.shrunk_s, _died=now,
                       node=self.node if node is None else node, _reached=max(self.completed.values(), default=0),
                       _generation=generation, _remote=remote)
        self.recoveries.append(rec)
        return rec

    def replace(self, lost: WorkerProcess, cause: RootCause, survivors: list[WorkerProcess],
                now: float) -> WorkerProcess | None:
        """The spare now serving `lost`'s rank, or None (said why, in one line)."""
        why = self.why_not(lost.slot.rank, [w.slot.rank for w in survivors])
        spare = None
        generation = self.next_generation
        if why is None:
            spare, why = self.pool.take()
        if spare is not None and self.regroup is not None:
            why = self._claim(generation, "replaced", {"spare": lost.slot.rank}, {
                "rank": lost.slot.rank, "device": lost.slot.tag, "failed": cause.message, "kind": cause.kind,
                "lost_pid": lost.pid, "replaced_by_pid": spare.pid, "died_at": _wall(now)})
            if why is not None:
                self.pool.put_back(spare)
                spare = None
        if spare is None:
            self._fail_in_flight(cause)
            logger.warning(f"live recovery not possible: {why}")
            return None
        new = self.pool.promote(spare, lost.slot, lost.log_path, self.env_for(lost.slot, spare, generation))
        if self.shrink_floor:  # the survivors wait for the word before they rebuild
            self._decide(generation, {"spare": lost.slot.rank})
        self.budget -= 1
        rec = Recovery(number=self.numbered_from + len(self.recoveries) + 1, attempt=self.attempt, rank=lost.slot.rank,
                       device=lost.slot.tag, failed=cause.message, kind=cause.kind, lost_pid=lost.pid,
                       replaced_by_pid=new.pid, survivors=_ranks_and_pids(survivors), started_at=now_iso(),
                       node=self.node, _died=now, _reached=max(self.completed.values(), default=0),
                       _generation=generation)
        self.recoveries.append(rec)
        others = f"the other {len(survivors)} worker(s)" if self.regroup is None else \
            f"every other node's workers and this node's {len(survivors)} other worker(s)"
        logger.warning(f"{cause.message}: live recovery {rec.number}: warm spare pid {new.pid} takes rank "
                       f"{rec.rank}; {others} keep running and rebuild the group with it")
        if self.budget > 0:  # a spare for the next failure, warming up at a low priority meanwhile
            started = self.pool.fill()
            if started:
                logger.info(f"new warm spare(s) pid {', '.join(str(s.pid) for s in started)} started in the "
                            "background (the pool of --spares refills)")
        return new

    def heard(self, generation: int, claim: dict[str, Any] | None, survivors: list[WorkerProcess],
              now: float) -> str | None:
        """Multi-node: a node claimed rebuilt group `generation` (this node's own claims come back
        too). Another node's is recorded as this node's recovery too, its ranks as the survivors;
        returns why this node cannot take part (the attempt must end: a job-wide restart)."""
        if claim is not None and claim.get("node") == self.node or generation <= self.joined_at:
            return None  # this node's own claim, or one made before this spare node took its place
        lost = f"node {claim.get('node')}'s rank {claim.get('rank')}" if claim else "a rank"
        why = self._why_not_join(generation, claim, [w.slot.rank for w in survivors])
        if why is not None:
            why = (f"live recovery not possible: {lost} was lost and is being replaced, but {why}; "
                   "restarting every worker")
            self._fail_in_flight(RootCause("rendezvous", ExitCode.FAILURE, why))
            return why
        if self.shrink_floor and isinstance(claim.get("decision"), dict):  # node 0: into the workers' store
            self._decide(generation, claim["decision"])
        died_at = claim.get("died_at")
        ago = max(0.0, time.time() - died_at) if isinstance(died_at, (int, float)) else 0.0
        if claim.get("action") in ("shrink", "regrow"):
            self._heard_resize(generation, claim, survivors, now - min(ago, STUCK_S))
            return None
        self.budget -= 1
        rec = Recovery(number=self.numbered_from + len(self.recoveries) + 1, attempt=self.attempt, rank=claim["rank"],
                       device=str(claim.get("device")), failed=str(claim.get("failed")), kind=str(claim.get("kind")),
                       lost_pid=int(claim.get("lost_pid") or 0), replaced_by_pid=int(claim.get("replaced_by_pid") or 0),
                       survivors=_ranks_and_pids(survivors), started_at=now_iso(), node=claim["node"],
                       _died=now - min(ago, STUCK_S), _reached=max(self.completed.values(), default=0),
                       _generation=generation, _remote=True)
        self.recoveries.append(rec)
        if isinstance(claim.get("spare_node"), int):  # a node died whole: a spare node takes its place
            rec.action, rec.spare_node = "spare-node", claim["spare_node"]
            logger.warning(f"{rec.failed}: live recovery {rec.number}: spare node {rec.spare_node} "
                           f"({claim.get('spare_host', '?')}) takes its ranks {claim.get('ranks', [rec.rank])}; this "
                           f"node's {len(survivors)} worker(s) keep running and rebuild the group with it")
            return None
        logger.warning(f"node {rec.node}: {rec.failed}: live recovery {rec.number}: its warm spare pid "
                       f"{rec.replaced_by_pid} takes rank {rec.rank}; this node's {len(survivors)} worker(s) keep "
                       "running and rebuild the group with it")
        return None

    def _heard_resize(self, generation: int, claim: dict[str, Any], survivors: list[WorkerProcess],
                      died: float) -> None:
        """Another node's shrink or regrow: this node's ranks rebuild the group with the claim's ranks."""
        ranks, node, rank = [int(r) for r in claim["decision"]["ranks"]], int(claim["node"]), int(claim["rank"])
        if claim["action"] == "regrow":
            rec = self._grown(rank, str(claim.get("device")), int(claim.get("replaced_by_pid") or 0), ranks,
                              survivors, died, generation, node=node, remote=True)
            logger.info(f"node {node}: live recovery {rec.number}: its warm spare pid {rec.replaced_by_pid} takes "
                        f"back rank {rank}: this node's {len(survivors)} worker(s) rebuild the group with it at "
                        f"their next step boundary ({len(ranks)} process(es))")
            return
        self.budget -= 1
        rec = Recovery(number=self.numbered_from + len(self.recoveries) + 1, attempt=self.attempt, rank=rank,
                       device=str(claim.get("device")), failed=str(claim.get("failed")), kind=str(claim.get("kind")),
                       lost_pid=int(claim.get("lost_pid") or 0), replaced_by_pid=0,
                       survivors=_ranks_and_pids(survivors), started_at=now_iso(), node=node, action="shrink",
                       replicas=len(ranks), _died=died, _reached=max(self.completed.values(), default=0),
                       _generation=generation, _remote=True)
        if rec.kind == "node":  # node 0 found the whole node dead, and no spare node free (node_shrink_agent.py)
            lost = ", ".join(str(r) for r in claim.get("ranks", [rank]))
            self._shrunk(rec, ranks, f"{rec.failed}: live recovery {rec.number}: no spare node left: this node's "
                                     f"{len(survivors)} worker(s) keep running",
                         without=f"node {node}'s rank(s) {lost} (it cannot come back before a restart), the "
                                 "survivors carrying their data slots")
            return
        self._shrunk(rec, ranks, f"node {node}: {rec.failed}: live recovery {rec.number}: no warm spare left there: "
                                 f"this node's {len(survivors)} worker(s) keep running")

    def promoted(self, generation: int, claim: dict[str, Any], newcomers: list[WorkerProcess], now: float) -> None:
        """A spare node took a dead node's place in rebuilt group `generation` (its workers, just
        started, are the newcomers): the recovery every other node records too, ended at the
        newcomers' first completed step."""
        self.joined_at = generation
        self.budget -= 1
        died_at = claim.get("died_at")
        ago = max(0.0, time.time() - died_at) if isinstance(died_at, (int, float)) else 0.0
        rec = Recovery(number=self.numbered_from + 1, attempt=self.attempt, rank=int(claim["rank"]),
                       device=str(claim.get("device")), failed=str(claim.get("failed")), kind=str(claim.get("kind")),
                       lost_pid=0, replaced_by_pid=newcomers[0].pid if newcomers else 0, survivors=[],
                       started_at=now_iso(), node=int(claim["node"]), _died=now - ago, _generation=generation,
                       action="spare-node", spare_node=claim.get("spare_node"))
        self.recoveries.append(rec)
        logger.warning(f"{rec.failed}: live recovery {rec.number}: this spare node takes node {rec.node}'s ranks "
                       f"{', '.join(str(r) for r in claim.get('ranks', [rec.rank]))} (pid(s) "
                       f"{', '.join(str(w.pid) for w in newcomers)}); every other node's workers keep running")

    def _why_not_join(self, generation: int, claim: dict[str, Any] | None, ranks: list[int]) -> str | None:
        if claim is None:
            return f"the claim of rebuilt group {generation} on the job store is unreadable"
        if generation != self.next_generation:
            return f"this node expected rebuilt group {self.next_generation}, not {generation}"
        action = claim.get("action", "replaced")
        if action in ("shrink", "regrow"):
            why = self._why_not_resize(action, claim)
            if why is not None:
                return why
        if action == "shrink" and (sharded := [r for r in ranks if r in self.no_shrink]):
            return f"this node's rank {sharded[0]}: {self.no_shrink[sharded[0]]}"  # fsdp: a node lost whole
        if self.off or self.in_flight is not None or (self.budget <= 0 and action != "regrow"):
            return f"on this node: {self.why_not(claim['rank'], ranks)}"
        for r in ranks:  # the lost rank is the other node's to judge
            if r not in self.able:
                return f"this node's rank {r} had not started training yet (no state to hand over)"
            if self.able[r] is not None:
                return f"this node's rank {r}: {self.able[r]}"
        return None

    def _why_not_resize(self, action: str, claim: dict[str, Any]) -> str | None:
        """A shrink or regrow claim this node cannot follow: shrinking is off here, or its decision
        is not one gpuherd writes (the store has no authentication), or names a rank not carried."""
        decision = claim.get("decision")
        ranks = decision.get("ranks") if isinstance(decision, dict) else None
        if not self.shrink_floor:
            return "this node does not shrink (--min-replicas 0 here)"
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks) or decision.get(action) != \
                claim["rank"]:
            return f"the {action} claimed on the job store names no group of ranks"
        if action == "regrow" and claim["rank"] not in self.shrunk_since:
            return f"rank {claim['rank']} is not carried here"
        return None

    def stuck(self, now: float, step_allowance: float) -> tuple[str, int] | None:
        """(why, a rank) when a survivor is still inside a collective of the broken group a step's
        allowance (at least STUCK_S) after the loss: gloo gives a rank waiting on a live peer (one
        that already left) no error, so it can never rejoin; the attempt must end (a restart)."""
        rec = self.in_flight
        wait = max(STUCK_S, step_allowance)
        if rec is None or now - rec._died < wait:
            return None
        left = self.left.get(rec._generation, {})
        missing = [s["rank"] for s in rec.survivors if s["rank"] not in left]
        if not missing:
            return None
        return (f"live recovery {rec.number} not possible: rank(s) {', '.join(map(str, missing))} stayed in a "
                f"collective of the broken group for {wait:.0f} s after rank {rec.rank} was lost (gloo raised no "
                "error there); restarting every worker"), missing[0]

    def give_up(self, cause: RootCause) -> None:
        """The supervision ends the attempt over `cause` while a recovery is in flight."""
        self._fail_in_flight(cause)

    def settle(self) -> list[dict[str, Any]]:
        """The attempt is over: its recoveries for summary.json (one still in flight failed)."""
        now = time.monotonic()
        for shrunk in self.shrunk_since.values():  # not grown back: shrunk to the end
            if shrunk.outcome == "recovered":
                shrunk.shrunk_s = round(now - shrunk._died, 3)
        rec = self.in_flight
        if rec is not None:
            rec.outcome = "failed"
            rec.failed = (f"{rec.failed}; " if rec.failed else "") + "the attempt ended before the rebuilt group " \
                "completed a step"
            self.write_metric({"type": "recovery", "time": time.time(), **rec.to_dict()})
        return [r.to_dict() for r in self.recoveries]

    def _fail_in_flight(self, cause: RootCause) -> None:
        rec = self.in_flight
        if rec is not None:
            rec.outcome = "failed"
            rec.failed = (f"{rec.failed}; then " if rec.failed else "") + f"{cause.message} during the recovery"
            self.write_metric({"type": "recovery", "time": time.time(), **rec.to_dict()})

    def observe(self, record: Record) -> None:
        """Every status record: who can be recovered live, steps completed, and the recovery's end."""
        rank = record.rank
        if rank is None:
            return
        rec = self.in_flight
        match record:
            case Step(step=int(step)) if rec is None:
                self.completed[rank] = max(self.completed.get(rank, 0), step + 1)
            case Step() if rec is not None and (rec._remote or rec.action == "shrink") and \
                    rank in self.rejoined.get(rec._generation, {}):
                joined = self.rejoined[rec._generation][rank]  # a survivor's first completed step in the rebuilt group
                rec.resumed_step, rec.source_rank = joined.step, joined.source
                self._finish(rec, time.monotonic())
            case LiveAble():
                self.able[rank] = None if record.able else (record.why or "cannot be recovered live")
                if self.lazy_spares and record.able and not self.pool.started and self.budget > 0:
                    self._first_spares()
                if record.no_shrink:
                    self.no_shrink[rank] = record.no_shrink
            case Done():
                self.finished = True
            case LiveLostPeer(step=int(step), generation=int(generation)):
                self.left.setdefault(generation, {})[rank] = step
            case LiveRejoined(role="newcomer") if rec is not None:
                rec.resumed_step, rec.source_rank, rec.rejoin_s = record.step, record.source, record.seconds
                self.able[rank] = None
            case LiveRejoined(generation=int(generation)):  # a survivor, in the new group
                self.rejoined.setdefault(generation, {})[rank] = record
            case LiveFirstStep() if rec is not None:
                self._finish(rec, time.monotonic())

    def _first_spares(self) -> None:
        """A script's ranks said they can be recovered live (gpuherd.live.attach): the pool's first
        spares start now, after the ranks' own start (a spare importing torch beside them slows it)."""
        started = self.pool.fill()
        if started:
            logger.info(f"warm spare(s) pid {', '.join(str(s.pid) for s in started)} started for the script's live "
                        "recovery (gpuherd.live)")

    def _finish(self, rec: Recovery, now: float) -> None:
        rec.outcome = "recovered"
        rec.seconds = round(now - rec._died, 3)
        resumed = rec.resumed_step or 0
        reached = max([rec._reached, *self.left.get(rec._generation, {}).values()])
        rec.steps_redone = max(0, reached - resumed)
        logger.warning(rec.line())
        self.write_metric({"type": "recovery", "time": time.time(), **rec.to_dict()})


def _wall(now: float) -> float:
    """The wall-clock time of monotonic `now` (a claim's time travels to other machines)."""
    return time.time() - (time.monotonic() - now)


def _ranks_and_pids(workers: list[WorkerProcess]) -> list[dict[str, int]]:
    return [{"rank": w.slot.rank, "pid": w.pid} for w in sorted(workers, key=lambda w: w.slot.rank)]
