"""Live recovery inside one rank: leave a group a lost peer broke, rejoin the rebuilt one, and
go on from the last completed step with the state of one survivor, without reading a checkpoint.

The supervisor decides (supervisor/processes/live_recovery.py); the ranks only act:

- survivors: a collective raised because a peer's connection closed (`is_peer_loss`) ->
  leave the broken group -> join generation g+1 (the same store, a new prefix, the same
  world size: a warm spare takes the lost rank) -> tell each other how many steps each
  completed -> wrap the model over the new group -> the source (the lowest rank among
  those that completed the most steps) broadcasts model, optimizer, grad scaler, RNG and
  data position; every other rank loads them.
- the newcomer (a warm spare, worker/spare.py) joins generation g at its start, learns the
  layout from the same exchange, builds its engine without collectives, and takes the state.

With --min-replicas (contract.SHRINK) a survivor first reads the supervisor's decision: a
spare comes (as above), or none is left and the survivors rebuild the group without the lost
rank (`on_slots`: a survivor may carry the lost rank's data slot, worker/data_slots.py).
The rank in the rebuilt group (`group_rank`) is then no longer `identity.rank`, which stays
what the supervisor keys logs and clocks by and the data slot each process owns. The group's
first rank leads (`on_place`): it writes the checkpoints and the run's scalars, so a shrink that
lost rank 0 hands them to its lowest survivor, and the regrow that brings rank 0 back hands
them back. While the
group is shrunk its first rank looks, at every step boundary, for the supervisor's word that
a warm spare takes back a carried rank (`regrow_due`); the stop vote carries it to every rank,
so all leave the group at the same step boundary and rebuild it with the newcomer (`regrow`),
which takes the state by the same broadcast; the carrier drops the slot.

Every rank keeps the data position and RNG state of its last completed step (`mark()`: a
few KB, no device sync), so the step in flight, cut short, is done again from exactly where
it began: losses after the recovery equal an uninterrupted run's, bit for bit. Strategies
whose every rank holds the whole state (DDP) hand it over by broadcast; FSDP, whose ranks each
hold a shard that exists nowhere else, keeps a copy of each rank's shard on its neighbour
(worker/shard_copies.py): the newcomer takes the lost rank's copy, every survivor returns to the
same step from its own snapshot (`_take_shards`). The others (`Engine.live_recoverable` False:
ZeRO-1, DeepSpeed) fall back to the supervisor's restart from a checkpoint.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from loguru import logger

from gpuherd import contract
from gpuherd.exit_codes import ExitCode
from worker import distributed as wdist
from gpuherd import rng
from worker.data_slots import loss_scale, slots_of
from gpuherd.broken_group import is_peer_loss, leave_broken_group
from worker.distributed import WorkerError
from worker.shard_copies import ShardCopies, restore_step
from gpuherd.state_broadcast import broadcast_state

if TYPE_CHECKING:
    from gpuherd.memory_plan import Layout
    from gpuherd.config import Config
    from gpuherd.contract import WorkerIdentity
    from gpuherd.liveness import Liveness
    from gpuherd.status_channel import StatusWriter
    from worker.engines import Buckets, Engine
    from worker.reporting import StepReporter
    from worker.saver import Saver


@dataclass(frozen=True)
class RecoveryParts:
    """What live recovery reads of a rank: its parts, the same objects for the process's life
    (each changes inside: the engine rewraps its model over a rebuilt group, the saver regroups)."""

    cfg: Config
    identity: WorkerIdentity
    device: torch.device
    layout: Layout
    layout_note: str | None
    engine: Engine
    status: StatusWriter
    live: Liveness
    saver: Saver
    reporter: StepReporter


class Recoverable(Protocol):
    """The calls through which the trainer changes its own state when live recovery asks (live
    recovery reads no trainer member and assigns none): its counters (`state_dict`, with the
    completed steps and what is owed after the last one, and `load_state_dict`), its data
    position (`data_position`, `rewind_data`), its group-bound objects (`on_group_lost`,
    `on_regroup`), the data slots it trains (`on_slots`) and its place in the group (`on_place`)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def data_position(self) -> dict[str, Any]: ...
    def rewind_data(self, sampler: dict[str, Any]) -> None: ...
    def on_group_lost(self) -> None: ...
    def on_regroup(self, buckets: Buckets | None) -> None: ...
    def on_slots(self, carried: list[int], scale: float) -> None: ...
    def on_place(self, group_rank: int) -> None: ...


_OWED = {"eval": "evaluation", "checkpoint": "periodic checkpoint"}


@dataclass
class Mark:
    """Where a rank stood after its last completed step."""

    step: int
    sampler: dict[str, Any]
    rng: dict[str, Any]


def why_not_live(strategy: str, recoverable: bool, world_size: int, copies: bool | None = None) -> str | None:
    """None when this rank can be recovered live; else the reason, said by the supervisor.
    `copies`: the strategy needs the buddy copies of its shards, and system.shard_copies is on
    (None: it needs none)."""
    if os.environ.get(contract.LIVE_RECOVERY) != "1":
        return "no warm spare (--spares 0, or --max-restarts 0)"
    if world_size < 2:
        return "a single worker has no peer to take the state from"
    if not recoverable:
        return (f"strategy {strategy} shards its state across ranks: the lost rank's shard exists nowhere else "
                "(live recovery needs ddp, or fsdp)")
    if copies is False:
        return (f"system.shard_copies=false: strategy {strategy}'s lost shard would exist nowhere else "
                "(no copy on a neighbour)")
    return None


# Why a sharded run cannot go on with fewer ranks (--min-replicas): said by the supervisor.
NO_SHRINK = "its shard cannot be spread over fewer ranks while training (a shrink of fsdp is not built)"


@dataclass(frozen=True)
class Joining:
    """A spare taking a lost rank: the rebuilt group it joined and what the survivors said there."""

    generation: int
    source: int  # the survivor whose state it takes
    layout: Layout
    note: str | None
    saves_blocking: str | None  # why checkpoints are written while the loop waits (None: in the background)
    buckets: Buckets | None  # the gradient buckets the survivors reduce in
    ranks: list[int]  # the group's members in group order (fewer than the ranks: still shrunk after a regrow)
    infos: list[dict[str, Any] | None]  # what every rank said in the exchange (None: the newcomer itself)


def join_as_newcomer(cfg: Config, identity: WorkerIdentity, device: torch.device, generation: int) -> Joining:
    """A spare's start on rebuilt group `generation`: join it, then the survivors' exchange
    (`LiveRecovery.rejoin`'s, from the newcomer's side), which names the layout and the source.
    A regrow's group (the supervisor's decision) may still lack other ranks: the newcomer then
    holds its index in it, as every member does."""
    ranks = list(range(identity.world_size))
    if os.environ.get(contract.SHRINK) == "1":
        decision = wdist.read_decision(cfg, generation)
        ranks = [int(r) for r in decision.get("ranks", ranks)]
        if "regrow" in decision and wdist.regrow_answer(cfg, generation) != "go":
            raise wdist.RegrowEnded(f"the shrunk group ended its training before rank {identity.rank} could rejoin")
    wdist.join_generation(cfg, replace(identity, rank=ranks.index(identity.rank), world_size=len(ranks)), device,
                          generation)
    infos = wdist.gather_objects(None)
    source = _source(infos)
    info = infos[source]
    return Joining(generation, source, info["layout"], info["note"], info["saves_blocking"], info["buckets"], ranks,
                   infos)


def _source(infos: list[dict[str, Any] | None]) -> int:
    best = max(info["step"] for info in infos if info is not None)
    return min(r for r, info in enumerate(infos) if info is not None and info["step"] == best)


class LiveRecovery:
    """One trainer's side of live recovery: the marks, the rejoin, the state hand-over."""

    def __init__(self, parts: RecoveryParts, trainer: Recoverable, joining: Joining | None = None) -> None:
        self.p, self.t = parts, trainer
        self.generation = joining.generation if joining is not None else 0
        engine, identity = parts.engine, parts.identity
        wants_copies = engine.shard_copies and engine.live_recoverable
        self.why_not = why_not_live(parts.layout.strategy, engine.live_recoverable, identity.world_size,
                                    parts.cfg.system.shard_copies if wants_copies else None)
        # FSDP: each rank's shard also on its neighbour (worker/shard_copies.py)
        self.copies = ShardCopies(engine.local_state, identity.rank, identity.world_size) \
            if wants_copies and self.why_not is None else None
        self._mark: Mark | None = None
        self._joined_at: int | None = None  # the step this rank (re)joined at, until its first step after
        # the group's members, in group order
        self.ranks = list(joining.ranks) if joining is not None else list(range(identity.world_size))
        self._watch = wdist.DecisionWatch(parts.cfg) if os.environ.get(contract.SHRINK) == "1" else None
        self._unwritten: int | None = None  # the step of a background save the lost peer cut short

    @property
    def group_rank(self) -> int:
        """This process's rank in the current group (identity.rank until a shrink)."""
        return self.ranks.index(self.p.identity.rank)

    def _step(self) -> int:
        """The trainer's completed steps (its counters say)."""
        return int(self.t.state_dict()["step"])

    @property
    def enabled(self) -> bool:
        return self.why_not is None

    @property
    def shrunk(self) -> bool:
        return len(self.ranks) < self.p.identity.world_size

    def regrow_due(self) -> int:
        """At a step boundary: the rebuilt group a warm spare waits in, when the supervisor decided
        to regrow (asked by the group's first rank only; the stop vote tells the others), else 0."""
        if self._watch is None or not self.shrunk or self.group_rank != 0:
            return 0
        return self.generation + 1 if self._watch.regrow(self.generation + 1) else 0

    def close_regrow(self) -> None:
        """Training ended while shrunk: a warm spare the supervisor hands a carried rank from now
        on finds the answer "ended" and exits 0 instead of waiting for a group that is gone."""
        if self._watch is not None and self.shrunk and self.group_rank == 0:
            self._watch.answer(self.generation + 1, "ended")

    def announce(self) -> None:
        """Tell the supervisor whether a lost peer of this rank can be replaced live. With shard
        copies: not before a complete copy of this rank's neighbour is here (`before_update`)."""
        if os.environ.get(contract.LIVE_RECOVERY) != "1":
            return
        why = self.why_not
        if why is None and self.copies is not None and not self.copies.ready:
            why = (f"no complete copy of its shard on rank {self.copies.buddy} yet (lost before the first "
                   "step's copy arrived)")
        self.p.status.send("live", event="able", able=why is None, why=why,
                           no_shrink=NO_SHRINK if self.copies is not None else None)

    def before_update(self) -> None:
        """Inside each step, after forward/backward, before the gradient norm's all-reduce: the shard
        copies sent after the last step have arrived (worker/shard_copies.py says why here)."""
        if self.copies is not None and self.copies.wait():
            self.announce()  # the first complete copy: a lost peer can be recovered live from now on

    def mark(self) -> None:
        """After each completed step (and before the first): what a rejoin rewinds to; with shard
        copies, this step's copy leaves for the neighbour (none before the optimizer has state)."""
        p, step = self.p, self._step()
        if self.enabled:
            self._mark = Mark(step, self.t.data_position(), rng.capture(p.device))
            if self.copies is not None and p.engine.optimizer.state:  # AdamW's state exists after a step
                self.copies.post(step, self._copy_header())
        if self._joined_at is not None and step > self._joined_at:
            self._joined_at = None  # the supervisor's clock of this recovery stops here
            p.status.send("live", event="first_step", generation=self.generation, step=step)

    def can_rejoin(self, exc: BaseException) -> bool:
        ready = self.copies is None or self.copies.shapes is not None
        return self.enabled and ready and self._mark is not None and is_peer_loss(exc)

    def rejoin(self, lost: str) -> None:
        """A survivor's whole recovery (`lost`: what the collective raised, one line); raises (the
        rank fails, the supervisor restarts everyone) if the rebuilt group does not form or a
        peer is lost again meanwhile."""
        p, started = self.p, time.perf_counter()
        self.generation += 1
        logger.warning(f"{p.identity.bracket} lost a peer at step {self._mark.step} ({lost}); rejoining "
                       f"rebuilt group {self.generation} with a spare in its place")
        p.status.send("live", event="lost_peer", generation=self.generation, step=self._mark.step)
        p.status.send("phase", name="rendezvous")
        p.live.at("rendezvous")
        if self.copies is not None:
            self.copies.settle()  # a neighbour's copy that finished arriving counts
        self._leave()
        self._unwritten = p.saver.cut_short()  # a sharded save in flight on the broken group
        decision = wdist.read_decision(p.cfg, self.generation) if os.environ.get(contract.SHRINK) == "1" else {}
        if "shrink" in decision and self.copies is not None:
            raise WorkerError(f"{p.identity.bracket} live recovery: told to go on without rank {decision['shrink']}, "
                              f"but {NO_SHRINK}", ExitCode.FAILURE)
        if "shrink" in decision:
            self._resize(decision["ranks"])
            logger.warning(f"{p.identity.bracket} no spare left for rank {decision['shrink']}: rebuilding the group "
                           f"with {len(self.ranks)} rank(s) (this one as rank {self.group_rank} of it)")
        self._rebuild(started)

    def regrow(self, generation: int) -> None:
        """Every rank of a shrunk group, at the same step boundary (the stop vote said so): leave
        the group and rebuild it as rebuilt group `generation` with the warm spare that takes back
        a carried rank; its carrier stops carrying that slot. The step boundary is the mark, so
        nothing is redone and the data goes on where it was."""
        p, started = self.p, time.perf_counter()
        decision = wdist.read_decision(p.cfg, generation)
        if self.group_rank == 0:
            self._watch.answer(generation, "go")  # the newcomer waits for this before it joins
        self.generation = generation
        p.status.send("phase", name="rendezvous")
        p.live.at("rendezvous")
        self._leave()
        before = slots_of(p.identity.rank, self.ranks, p.identity.world_size)
        self._resize(decision["ranks"])
        dropped = [s for s in before if s not in slots_of(p.identity.rank, self.ranks, p.identity.world_size)]
        if self.group_rank == 0 or dropped:
            logger.info(f"{p.identity.bracket} a warm spare takes back rank {decision['regrow']}: rebuilding the "
                        f"group with {len(self.ranks)} rank(s) at step {self._step()}"
                        + (f"; this rank no longer carries data slot(s) {', '.join(map(str, dropped))}"
                           if dropped else ""))
        self._rebuild(started)

    def _resize(self, ranks: list[int]) -> None:
        """The group's members are `ranks` from now on: the data slots this process trains, and its
        loss scale, follow (worker/data_slots.py)."""
        p, t, world = self.p, self.t, self.p.identity.world_size
        self.ranks = [int(r) for r in ranks]
        t.on_slots(slots_of(p.identity.rank, self.ranks, world)[1:], loss_scale(len(self.ranks), world))
        t.on_place(self.group_rank)  # place 0 leads (checkpoints, scalars): rank 0, or its lowest survivor

    def _rebuild(self, started: float) -> None:
        """Join rebuilt group `generation` with the members `ranks`, agree on the source, take its state."""
        p, t = self.p, self.t
        wdist.join_generation(p.cfg, replace(p.identity, rank=self.group_rank, world_size=len(self.ranks)), p.device,
                              self.generation)
        infos = wdist.gather_objects({"step": self._mark.step, "layout": p.layout, "note": p.layout_note,
                                      "saves_blocking": p.saver.why_blocking, "buckets": p.engine.buckets,
                                      "counters": t.state_dict(), "unwritten": self._unwritten,
                                      "copies": self.copies.report() if self.copies is not None else None})
        source = _source(infos)
        t.on_regroup(infos[source]["buckets"])
        if self.copies is not None:
            source = self._take_shards(infos)
        else:
            behind = infos[self.group_rank]["step"] < infos[source]["step"]
            self._take_state(source, behind)
        self._rejoined(started, source, "source" if self.group_rank == source else "survivor")

    def _leave(self) -> None:
        """Destroy the broken group for real: a peer still waiting in a collective on this rank (a
        gloo algorithm whose next message was to come from here) is freed only once this rank's
        connections close, which happens when the last reference to the group goes."""
        self.t.on_group_lost()
        if self.copies is not None:
            self.copies.drop_group()
        leave_broken_group()
        gc.collect()

    def join(self, joining: Joining) -> None:
        """The newcomer, at the end of its trainer's construction: the survivors' state (a regrow
        into a group still shrunk: the slots it carries too)."""
        started = time.perf_counter()
        if self.shrunk:
            self._resize(self.ranks)
        source = joining.source
        if self.copies is not None:
            source = self._take_shards(joining.infos)
        else:
            self._take_state(source, behind=True)
        self._joined_at = self._step()
        self._rejoined(started, source, "newcomer")

    def _take_state(self, source: int, behind: bool) -> None:
        """The source's state by broadcast; a rank already at its step keeps its own (the same
        bits) and only rewinds its data position and RNG to its mark."""
        p = self.p
        mine = self._state() if self.group_rank == source else None
        state = broadcast_state(mine, source, p.device)
        if behind:
            self._load(state)
        else:
            self._rewind(self._mark.sampler, self._mark.rng)
        self._settled(state)

    def _settled(self, counters: dict[str, Any], cut: int | None = None) -> None:
        """The loop's counters of the step the rebuilt group goes on from, and that step's mark.
        `cut`: the step of a background save the loss cut short (None: none was)."""
        p, t = self.p, self.t
        t.load_state_dict(counters)
        owed, step = counters.get("owed", []), counters["step"]
        if self.group_rank == 0 and cut is not None and cut < step and "checkpoint" in owed:
            logger.warning(f"{p.identity.bracket} the checkpoint of step {cut} was cut short by the lost peer and "
                           f"no rank holds that step's state any more: the rebuilt group saves step {step} in its "
                           "place now")
            owed = [o for o in owed if o != "checkpoint"]
        if owed and self.group_rank == 0:
            logger.warning(f"{p.identity.bracket} the {' and the '.join(_OWED[o] for o in owed)} of step {step} "
                           "was cut short by the lost peer: the rebuilt group does it now")
        self._mark = Mark(self._step(), t.data_position(), rng.capture(p.device))

    def _take_shards(self, infos: list[dict[str, Any] | None]) -> int:
        """Sharded state: every rank returns to the newest step of the lost rank's copy on its buddy
        that every survivor has a snapshot of (`restore_step`; at most one step back): the buddy
        sends the copy to the newcomer, each survivor takes its own snapshot of that step back.
        Then the copies start again in the rebuilt group. Returns the buddy's place (the source)."""
        p = self.p
        step, why = restore_step([info["copies"] if info is not None else None for info in infos])
        if step is None:
            raise WorkerError(f"{p.identity.bracket} live recovery not possible: {why}", ExitCode.FAILURE)
        lost = next(r for r, info in enumerate(infos) if info is None)
        buddy = (lost + 1) % len(infos)
        at_step = [r for r, info in enumerate(infos) if info is not None and info["step"] == step]
        # a survivor still at that step knows what its lost peer cut short after it (owed); else
        # the step's own counters, which every snapshot of it carries
        counters = infos[at_step[0]]["counters"] if at_step else None
        # a background save the loss cut short is written again (as an owed one): of that step, or,
        # where the write was of an older step whose state no rank holds any more, of that step in its place
        cut = max((info["unwritten"] for info in infos if info is not None and info["unwritten"] is not None),
                  default=None)
        rewrite = cut is not None and cut <= step
        self.copies.regroup()
        if self.group_rank == lost:
            header = self.copies.receive(infos[buddy]["copies"]["shapes"])
        else:
            if self.group_rank == buddy:
                self.copies.send_held(step, lost)
            header = self.copies.restore_own(step)
        self._rewind(header["sampler"], header["rng"])
        counters = dict(counters if counters is not None else header["counters"])
        if rewrite and "checkpoint" not in counters["owed"]:
            counters["owed"] = [*counters["owed"], "checkpoint"]
        self._settled(counters, cut)
        self.copies.restart(step, self._copy_header())
        return buddy

    def _copy_header(self) -> dict[str, Any]:
        """What travels with a shard copy of the marked step: the mark, and the loop's counters
        (what is owed after the step is not done yet when the copy leaves)."""
        return {"sampler": self._mark.sampler, "rng": self._mark.rng, "counters": {**self.t.state_dict(), "owed": []}}

    def _state(self) -> dict[str, Any]:
        engine = self.p.engine
        return {**self.t.state_dict(), "step": self._mark.step,
                "model": engine.inner.state_dict(), "optimizer": engine.optimizer.state_dict(),
                "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
                "sampler": self._mark.sampler, "rng": self._mark.rng}

    def _load(self, state: dict[str, Any]) -> None:
        engine = self.p.engine
        engine.inner.load_state_dict(state["model"])
        engine.optimizer.load_state_dict(state["optimizer"])
        if engine.scaler is not None and state["scaler"] is not None:
            engine.scaler.load_state_dict(state["scaler"])
        sampler = dict(state["sampler"])
        if "rank" in sampler:  # a sampler's position is the same on every rank but for its rank
            sampler["rank"] = self.p.identity.rank
        self._rewind(sampler, state["rng"])

    def _rewind(self, sampler: dict[str, Any], rng_state: dict[str, Any]) -> None:
        """Data position and RNG back to the last completed step (the step in flight is redone)."""
        p, t = self.p, self.t
        p.engine.optimizer.zero_grad(set_to_none=True)
        t.rewind_data(sampler)
        rng.restore(rng_state, p.device)

    def _rejoined(self, started: float, source: int, role: str) -> None:
        p, step = self.p, self._step()
        seconds = time.perf_counter() - started
        p.status.send("live", event="rejoined", generation=self.generation, step=step, source=self.ranks[source],
                      role=role, seconds=round(seconds, 4), replicas=len(self.ranks),
                      slots=slots_of(p.identity.rank, self.ranks, p.identity.world_size))
        p.status.send("phase", name="train")
        p.reporter.exclude_pause(seconds)
        if self.group_rank == source:
            logger.info(f"{p.identity.bracket} rebuilt group {self.generation} formed: continuing from step {step} "
                        f"with this rank's state ({seconds:.2f} s, no checkpoint read)")

