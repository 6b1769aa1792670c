"""Live recovery, the supervisor's side: a lost rank is replaced by a warm spare while the
other workers keep their processes (worker/live_recovery.py is the ranks' side).

This is the executor: every decision is live_policy.py's, a pure function of the events this
class turns what it sees into (a rank lost, a spare warm, another node's claim, a rank's
`able` record); it carries the policy's actions out (takes and promotes spares, claims rebuilt
groups, tells the workers' store, records) and answers with what came of them.

When a rank dies (an exit, a signal, or a SIGKILL after a hang verdict), the supervision
policy (policy.py) decides from `why_not` whether live recovery applies; `recover()` then
either promotes a spare to its rank (the survivors notice the closed connections in their next
collective and rebuild the group with it), shrinks the group (below), or says in one line why
live recovery cannot apply, and the supervision tears down as before: a restart from the last
checkpoint.
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
(the policy's `Shrink`): the decision goes into the workers' store (contract.DECISION_KEY,
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
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
from loguru import logger

from gpuherd import contract
from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import Done, LiveAble, LiveFirstStep, LiveLostPeer, LiveRejoined, Record, Step

from supervisor.gpus import DeviceSlot
from supervisor.processes import live_policy as lp
from supervisor.processes.recovery_record import Recovery, begun, ranks_and_pids
from supervisor.processes.spares import SparePool
from supervisor.processes.spawn import WorkerProcess
from supervisor.rendezvous import LiveClaim, decode_claim
from supervisor.summary import RootCause, now_iso

STUCK_S = 10.0  # after a loss, every survivor has left the broken group's collective by then, or never will
FILLED = {"refill": "new warm spare(s) pid {} started in the background (the pool of --spares refills)",
          "regrow": "new warm spare(s) pid {} started in the background: the group grows back once one is warm",
          "first": "warm spare(s) pid {} started for the script's live recovery (gpuherd.live)"}
FORKED = {"refill": "a new warm spare asked of the spare source pid {} (a fork of its warm interpreter: the pool of "
                    "--spares refills)",
          "regrow": "a new warm spare asked of the spare source pid {} (a fork of its warm interpreter): the group "
                    "grows back once it is there",
          "first": "warm spare(s) asked of the spare source pid {} for the script's live recovery (gpuherd.live)"}


class Regroup(Protocol):
    """A multi-node job's control plane for live recovery (supervisor/rendezvous/regroup_link.py)."""

    def claim(self, generation: int, claim: dict[str, Any]) -> str | None:
        """None: rebuilt group `generation` is this node's to form; else why not."""

    def follow(self, on_claim: Callable[[int, dict[str, Any] | None], None]) -> None:
        """Every node's claims of this attempt from now on, to `on_claim` (any thread)."""

    def stop(self) -> None:
        """No call of `on_claim` after this returns."""


@dataclass(frozen=True)
class Loss:
    """What a recovery's record says of its rank and of who took it (the policy decides the rest)."""

    device: str
    failed: str
    kind: str
    died: float  # monotonic
    lost_pid: int = 0
    pid: int = 0  # the process that takes the rank (0: none, a shrink)
    survivors: list[WorkerProcess] = field(default_factory=list)
    claim: LiveClaim | None = None  # another node's claim, as heard
    newcomers: tuple[int, ...] = ()  # a spare node: its workers' pids


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
        self.pool, self.attempt, self.env_for = pool, attempt, env_for
        self.numbered_from, self.write_metric = numbered_from, write_metric
        self.regroup, self.tell = regroup, tell
        self.rules = lp.Rules(off=off, shrink_floor=shrink_floor, world_size=world_size, node=node,
                              multi_node=regroup is not None, script=script)
        self.state = lp.State(budget=budget)  # every decision's facts, changed by live_policy.decide only
        self.worker_env = dict(worker_env or {contract.LIVE_RECOVERY: "1"})
        self.lazy_spares = lazy_spares
        self.asked: dict[int, int] = {}  # a spare an operator asked for (`gpuherd spare`): its pid -> the rank it takes
        self.completed: dict[int, int] = {}  # rank -> completed steps it reported
        self.recoveries: list[Recovery] = []
        # rebuilt group -> {survivor rank: completed steps}: its `lost_peer` records, which may come
        # before the supervisor has even reaped the lost rank
        self.left: dict[int, dict[int, int]] = {}
        # rebuilt group -> {survivor rank: its `rejoined` record}: in a multi-node job a survivor may
        # rejoin before the supervisor has heard of another node's claim
        self.rejoined: dict[int, dict[int, LiveRejoined]] = {}

    # ------------------------------------------------------------------ the policy's state, read

    @property
    def off(self) -> str | None:
        return self.rules.off

    @property
    def shrink_floor(self) -> int:
        return self.rules.shrink_floor

    @property
    def budget(self) -> int:
        return self.state.budget

    @property
    def finished(self) -> bool:
        return self.state.finished

    @property
    def group(self) -> list[int] | None:
        """Shrunk: the ranks training on, job-wide (a regrow adds one back)."""
        return list(self.state.group) if self.state.group is not None else None

    @property
    def next_generation(self) -> int:
        return self.state.next_generation

    @property
    def in_flight(self) -> Recovery | None:
        return self.recoveries[-1] if self.state.in_flight is not None else None

    def why_not(self, rank: int, survivors: list[int], suspect_gpu: bool = False) -> str | None:
        """None when live recovery can take `rank` now; else the reason, in words for the user."""
        return lp.why_not(self.state, self.rules, rank, survivors, suspect_gpu, self._spare_ready(suspect_gpu))

    def shrinks(self, suspect_gpu: bool = False) -> bool:
        """A loss now shrinks the group (live_policy.shrinks)."""
        return lp.shrinks(self.state, self.rules, suspect_gpu, self._spare_ready(suspect_gpu))

    def _spare_ready(self, suspect_gpu: bool) -> bool:
        """A live spare waits: read only where the answer matters (a shrink is possible)."""
        return self.pool.ready() if self.rules.shrink_floor and self.state.group is None and not suspect_gpu else True

    def members(self) -> list[int]:
        return lp.members(self.state, self.rules)

    def carried(self) -> list[int]:
        return lp.carried(self.state)

    def carried_elsewhere(self) -> dict[int, int]:
        return lp.carried_elsewhere(self.state)

    def dead_nodes(self) -> tuple[int, ...]:
        return lp.dead_nodes(self.state)

    def regrow_candidate(self) -> int | None:
        """The carried rank a warm spare can take back now, or None (live_policy.regrow_candidate;
        no spare is warm yet)."""
        if lp.regrow_candidate(self.state) is None:
            return None
        spare = self.pool.warm()
        return None if spare is None else lp.regrow_candidate(self.state, self.asked.get(spare.pid))

    # ------------------------------------------------------------------ events in, actions carried out

    def _step(self, event: lp.Event) -> tuple[lp.Action, ...]:
        self.state, actions = lp.decide(self.state, event, self.rules)
        return actions

    def _carry(self, actions: tuple[lp.Action, ...], loss: Loss | None = None,
               cause: RootCause | None = None) -> lp.GiveUp | None:
        """Carry out the policy's actions that need no answer; a `GiveUp`, returned, fails the
        recovery in flight over `cause`."""
        for action in actions:
            match action:
                case lp.Record():
                    self._record(action, loss)
                case lp.FillPool(why=why):
                    asked, started = self.pool.asked, self.pool.fill(awaited=why == "regrow")
                    if started:
                        logger.info(FILLED[why].format(", ".join(str(s.pid) for s in started)))
                    elif self.pool.asked > asked:
                        logger.info(FORKED[why].format(self.pool.source.process.pid))
                case lp.Tell(generation=generation, decision=decision):
                    self._tell_workers(generation, dict(decision))
                case lp.Warn(message=message):
                    logger.warning(message)
                case lp.GiveUp():
                    if action.in_flight and cause is not None:
                        self._failed(self.recoveries[-1], cause)
                    return action
        return None

    def _record(self, a: lp.Record, loss: Loss) -> Recovery:
        """Recovery `a` begins: recorded, and said in one line."""
        rec = Recovery(number=self.numbered_from + a.nth, attempt=self.attempt, rank=a.rank, device=loss.device,
                       failed=loss.failed, kind=loss.kind, lost_pid=loss.lost_pid, replaced_by_pid=loss.pid,
                       survivors=ranks_and_pids(loss.survivors), started_at=now_iso(), node=a.node, action=a.how,
                       replicas=a.replicas, _died=loss.died, _reached=max(self.completed.values(), default=0),
                       _generation=a.generation, _remote=a.remote)
        if a.how == "spare-node":
            rec.spare_node = loss.claim.spare_node if loss.claim is not None else None
        if a.how == "regrow":
            shrink = self._shrink_of(a.rank)
            shrink.shrunk_s = rec.shrunk_s = round(loss.died - shrink._died, 3)
        self.recoveries.append(rec)
        line = begun(rec, a.ranks, len(loss.survivors), self.regroup is not None,
                     *_said_of_node(loss.claim, a.rank), loss.newcomers)
        logger.log("INFO" if a.how == "regrow" else "WARNING", line)
        return rec

    def _shrink_of(self, rank: int) -> Recovery:
        return next(r for r in reversed(self.recoveries) if r.action == "shrink" and r.rank == rank)

    # ------------------------------------------------------------------ this node's rank lost

    def recover(self, lost: WorkerProcess, cause: RootCause, survivors: list[WorkerProcess], now: float,
                suspect_gpu: bool = False) -> tuple[bool, WorkerProcess | None]:
        """`lost` died: the policy decides (a warm spare takes its rank, the survivors go on without
        it, or no live recovery: said why in one line). (True, the spare now serving the rank, or
        None for a shrink), or (False, None): the supervision restarts every worker."""
        actions = self._step(lp.Lost(lost.slot.rank, tuple(w.slot.rank for w in survivors), suspect_gpu,
                                     self._spare_ready(suspect_gpu)))
        (action,) = actions
        claim = {"rank": lost.slot.rank, "device": lost.slot.tag, "failed": cause.message, "kind": cause.kind,
                 "lost_pid": lost.pid, "died_at": _wall(now)}
        new, why = None, None
        if isinstance(action, lp.Shrink):
            why = self._agree(action.generation, "shrink", {"shrink": action.rank, "ranks": list(action.ranks)},
                              {**claim, "replaced_by_pid": 0})
        elif isinstance(action, lp.Promote):
            new, why = self._promote(action, lost, claim)
        if isinstance(action, lp.GiveUp) or why is not None:
            give_up = self._carry(actions if why is None else self._step(lp.Refused(why)), cause=cause)
            logger.warning(f"live recovery not possible: {give_up.why}")
            return False, None
        self._carry(self._step(lp.Done()), Loss(lost.slot.tag, cause.message, cause.kind, now, lost.pid,
                                                new.pid if new is not None else 0, survivors))
        return True, new

    def _promote(self, action: lp.Promote, lost: WorkerProcess,
                 claim: dict[str, Any]) -> tuple[WorkerProcess | None, str | None]:
        """A spare out of the pool, claimed for the rank (multi-node), promoted: it, or why not."""
        spare, why = self.pool.take()
        if spare is not None and self.regroup is not None:
            why = self._claim(action.generation, "replaced", {"spare": action.rank},
                              {**claim, "replaced_by_pid": spare.pid})
            if why is not None:
                self.pool.put_back(spare)
                spare = None
        if spare is None:
            return None, why
        new = self.pool.promote(spare, lost.slot, lost.log_path, self.env_for(lost.slot, spare, action.generation))
        if action.tell:  # the survivors wait for the word before they rebuild
            self._tell_workers(action.generation, {"spare": action.rank})
        return new, None

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
        if why is None and not self._tell_workers(generation, decision) and \
                (self.regroup is None or self.tell is not None):
            why = "the rendezvous store is gone, so the workers cannot be told"
        return why

    def _tell_workers(self, generation: int, decision: dict[str, Any]) -> bool:
        """The supervisor's word on rebuilt group `generation`, into the workers' store
        (contract.DECISION_KEY); False: there is no store to tell, or it is gone."""
        return self.tell is not None and bool(self.tell(contract.DECISION_KEY.format(generation=generation),
                                                        orjson.dumps(decision).decode()))

    # ------------------------------------------------------------------ a carried rank grown back

    def ask_spare(self, rank: int) -> WorkerProcess:
        """One warm spare more for carried rank `rank` (`gpuherd spare`): it takes the rank back once warm."""
        spare = self.pool.add(awaited=True)
        self.asked[spare.pid] = rank
        return spare

    def regrow(self, slot: DeviceSlot, log_path: Any, survivors: list[WorkerProcess],
               now: float) -> WorkerProcess | None:
        """A warm spare takes back carried rank `slot.rank`; the group rebuilds with it at its next
        step boundary. None (said why): the decision could not reach the workers."""
        spare = self.pool.take_warm()
        if spare is None:
            return None
        actions = self._step(lp.SpareWarm(slot.rank, spare.pid))
        if not actions:
            self.pool.put_back(spare)
            return None
        (action,) = actions
        why = self._agree(action.generation, "regrow", {"regrow": slot.rank, "ranks": list(action.ranks)}, {
            "rank": slot.rank, "device": slot.tag, "failed": "", "kind": "regrow", "lost_pid": 0,
            "replaced_by_pid": spare.pid, "died_at": _wall(now)})
        if why is not None:
            self.pool.put_back(spare)
            self._carry(self._step(lp.Refused(why, spare.pid)))
            return None
        new = self.pool.promote(spare, slot, log_path, self.env_for(slot, spare, action.generation))
        self._carry(self._step(lp.Done()), Loss(slot.tag, "", "regrow", now, pid=new.pid, survivors=survivors))
        return new

    # ------------------------------------------------------------------ multi-node: the other nodes' claims

    def heard(self, generation: int, claim: dict[str, Any] | None, survivors: list[WorkerProcess],
              now: float) -> str | None:
        """Multi-node: a node claimed rebuilt group `generation` (this node's own claims come back
        too). Another node's is recorded as this node's recovery too, its ranks as the survivors;
        returns why this node cannot take part (the attempt must end: a job-wide restart)."""
        heard = decode_claim(claim)  # decoded here once, as it comes from the job store
        actions = self._step(lp.Heard(generation, _decoded(heard), tuple(w.slot.rank for w in survivors)))
        loss = None
        if heard is not None:
            loss = Loss(str(heard.device), str(heard.failed), str(heard.kind), now - min(_ago(heard), STUCK_S),
                        heard.lost_pid, heard.replaced_by_pid, survivors, heard)
        give_up = self._carry(actions, loss)
        if give_up is not None:
            if give_up.in_flight:
                self._failed(self.recoveries[-1], RootCause("rendezvous", ExitCode.FAILURE, give_up.why))
            return give_up.why
        return None

    def promoted(self, generation: int, claim: dict[str, Any], newcomers: list[WorkerProcess], now: float) -> None:
        """A spare node took a dead node's place in rebuilt group `generation` (its workers, just
        started, are the newcomers): the recovery every other node records too, ended at the
        newcomers' first completed step."""
        took = decode_claim(claim)  # decoded here once (the agent checked it: node 0 wrote it)
        if took is None:
            logger.warning(f"a spare node's promotion to rebuilt group {generation} carries no claim gpuherd writes "
                           f"({claim!r:.200}): not recorded as a recovery")
            return
        actions = self._step(lp.SpareNodeJoined(generation, took.rank, took.node))
        self._carry(actions, Loss(str(took.device), str(took.failed), str(took.kind), now - _ago(took),
                                  pid=newcomers[0].pid if newcomers else 0, claim=took,
                                  newcomers=tuple(w.pid for w in newcomers)))

    # ------------------------------------------------------------------ the recovery's end

    def stuck(self, now: float, step_allowance: float) -> tuple[str, int] | None:
        """(why, a rank) when a survivor is still inside a collective of the broken group a step's
        allowance (at least STUCK_S) after the loss: gloo gives a rank waiting on a live peer (one
        that already left) no error, so it can never rejoin; the attempt must end (a restart).
        A regrow breaks no group: its survivors leave theirs at the step boundary the decision
        named (they send no `lost_peer`), so none is ever stuck in it; a newcomer slow to its first
        step (its trainer built beside busy ranks) is waited for, one that never comes is the
        heartbeat monitor's (the survivors wait in the rendezvous, under its allowance)."""
        rec = self.in_flight
        wait = max(STUCK_S, step_allowance)
        if rec is None or rec.action == "regrow" or now - rec._died < wait:
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
        rec = self.in_flight
        if rec is not None:
            self._step(lp.Ended(recovered=False))
            self._failed(rec, cause)

    def settle(self) -> list[dict[str, Any]]:
        """The attempt is over: its recoveries for summary.json (one still in flight failed)."""
        now = time.monotonic()
        for rank in self.state.carried:  # not grown back: shrunk to the end
            shrunk = self._shrink_of(rank)
            if shrunk.outcome == "recovered":
                shrunk.shrunk_s = round(now - shrunk._died, 3)
        rec = self.in_flight
        if rec is not None:
            self._step(lp.Ended(recovered=False))
            rec.outcome = "failed"
            rec.failed = (f"{rec.failed}; " if rec.failed else "") + "the attempt ended before the rebuilt group " \
                "completed a step"
            self.write_metric({"type": "recovery", "time": time.time(), **rec.to_dict()})
        return [r.to_dict() for r in self.recoveries]

    def _failed(self, rec: Recovery, cause: RootCause) -> None:
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
                why = None if record.able else (record.why or "cannot be recovered live")
                due = self.lazy_spares and not self.pool.started
                self._carry(self._step(lp.Able(rank, why, record.no_shrink, spares_due=due)))
            case Done():
                self._step(lp.TrainingDone())
            case LiveLostPeer(step=int(step), generation=int(generation)):
                self.left.setdefault(generation, {})[rank] = step
            case LiveRejoined(role="newcomer") if rec is not None:
                rec.resumed_step, rec.source_rank, rec.rejoin_s = record.step, record.source, record.seconds
                self._step(lp.Able(rank))
            case LiveRejoined(generation=int(generation)):  # a survivor, in the new group
                self.rejoined.setdefault(generation, {})[rank] = record
            case LiveFirstStep() if rec is not None:
                self._finish(rec, time.monotonic())

    def _finish(self, rec: Recovery, now: float) -> None:
        self._step(lp.Ended(recovered=True))
        rec.outcome = "recovered"
        rec.seconds = round(now - rec._died, 3)
        resumed = rec.resumed_step or 0
        reached = max([rec._reached, *self.left.get(rec._generation, {}).values()])
        rec.steps_redone = max(0, reached - resumed)
        logger.warning(rec.line())
        self.write_metric({"type": "recovery", "time": time.time(), **rec.to_dict()})


def _decoded(claim: LiveClaim | None) -> lp.Claim | None:
    """Another node's claim as the policy reads it (the job store has no authentication: a
    shrink's or regrow's group that gpuherd would not write reads as none)."""
    if claim is None:
        return None
    group = claim.group if claim.decided == claim.rank else None
    return lp.Claim(claim.node, claim.rank, claim.action, group, claim.decision, claim.spare_node,
                    whole_node=claim.kind == "node")


def _said_of_node(claim: LiveClaim | None, rank: int) -> tuple[list[int], str]:
    """A node that died whole: its ranks and the spare node's host, as its claim says them."""
    ranks = claim.ranks if claim is not None and claim.ranks is not None else (rank,)
    return list(ranks), (claim.spare_host if claim is not None and claim.spare_host is not None else "?")


def _ago(claim: LiveClaim) -> float:
    """How long ago the claim's loss was (its wall-clock `died_at`), 0 where it says none."""
    return max(0.0, time.time() - claim.died_at) if claim.died_at is not None else 0.0


def _wall(now: float) -> float:
    """The wall-clock time of monotonic `now` (a claim's time travels to other machines)."""
    return time.time() - (time.monotonic() - now)
