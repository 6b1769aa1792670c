"""Live recovery's decisions, as a pure function of what happened: a lost rank taken by a warm
spare, the group shrunk without it, or no live recovery (why not, in words: the supervision then
restarts every worker); a carried rank grown back; another node's claim followed or refused.

`decide(state, event, rules) -> (state, actions)`, in the shape of attempt_policy.py: the state
is one immutable record (`State`: the recoveries --max-restarts still allows, the one in flight,
the shrunk group and its carried ranks, which ranks can be recovered live, the action being
carried out); an event says what happened (`Lost`, `SpareWarm`, `Heard`, `SpareNodeJoined`, the
shell's answer `Done`/`Refused`, the ranks' `Able`/`TrainingDone`, a recovery's `Ended`); an action
says what to do (`Promote` a spare, `Shrink`, `Regrow`, `Record` a recovery, `Tell` the workers'
store, `FillPool`, `GiveUp`, `Warn`). No process, file or clock here: live_recovery.py's
`LiveRecovery` takes the spares, claims the rebuilt group, writes the records and the lines, and
answers a `Promote`/`Shrink`/`Regrow` with `Done` or `Refused`; tests/supervisor/test_live_policy.py
drives every branch with synthetic events in milliseconds. The flow (docs/design/live-recovery.md):

    Lost --why not (off, in flight, no budget, no survivor, a rank not able, below the floor)--> GiveUp
    Lost --no warm spare, --min-replicas (or shrunk, or its GPU suspect)--> Shrink --Done--> FillPool, Record
    Lost --a warm spare--> Promote --Done--> Record, FillPool (while budget is left)
    Promote/Shrink --Refused (no spare after all, another node's claim, the store gone)--> GiveUp
    SpareWarm (a carried rank, the group shrunk) --> Regrow --Done--> Record | --Refused--> Warn
    Heard (another node's claim) --> Tell (node 0), Record | GiveUp (this node cannot follow it)
    SpareNodeJoined (this spare node took a dead node's place) --> Record

Every recovery but a regrow (nothing failed) uses one of --max-restarts (`uses_restart`): the
attempt's live budget counts it down here only (`_begin`), every node alike for a job's recovery,
and the attempt loop counts what an attempt used by the same rule (`restarts_used`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

# ---------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Rules:
    """Fixed for the attempt."""

    off: str | None = None  # why live recovery is off for the whole attempt
    shrink_floor: int = 0  # --min-replicas (0: never shrink)
    world_size: int = 0  # the job's ranks (multi-node: every node's)
    node: int | None = None  # multi-node: this node's rank
    multi_node: bool = False  # the job's control plane claims each rebuilt group
    script: bool = False  # the ranks run a user's script, recovered live through gpuherd.live


@dataclass(frozen=True)
class Lost:
    """One of this node's ranks died (the supervision policy's `ReplaceLive`)."""

    rank: int
    survivors: tuple[int, ...]  # this node's ranks still alive
    suspect_gpu: bool = False  # it left over its own GPU: a spare promoted into its slot would train on it
    spare_ready: bool = True  # a live spare waits in the pool


@dataclass(frozen=True)
class SpareWarm:
    """A warm spare, out of the pool, is there to take back carried rank `rank` (the shell asked
    `regrow_candidate` which)."""

    rank: int
    pid: int


@dataclass(frozen=True)
class Claim:
    """Another node's claim of a rebuilt group, as decoded (live_recovery.py's `_decoded`)."""

    node: int | None
    rank: int
    action: str = "replaced"  # replaced | shrink | regrow
    ranks: tuple[int, ...] | None = None  # shrink, regrow: the group it names (None: none readable)
    decision: Mapping | None = None  # its word for the workers' store, as claimed
    spare_node: int | None = None  # a node died whole: the spare node that takes its place
    whole_node: bool = False  # a shrink over a node that died whole (node 0's verdict)


@dataclass(frozen=True)
class Heard:
    """Multi-node: a node claimed rebuilt group `generation` (None: its claim is unreadable)."""

    generation: int
    claim: Claim | None
    survivors: tuple[int, ...]  # this node's ranks alive


@dataclass(frozen=True)
class SpareNodeJoined:
    """This spare node took dead node `node`'s place (from its rank `rank`) in rebuilt group `generation`."""

    generation: int
    rank: int
    node: int


@dataclass(frozen=True)
class Done:
    """The shell carried out the pending `Promote`, `Shrink` or `Regrow`."""


@dataclass(frozen=True)
class Refused:
    """The pending action could not be carried out: why (`spare`: the pid of the spare it had taken)."""

    why: str
    spare: int = 0


@dataclass(frozen=True)
class Able:
    """A rank said whether it can be recovered live (`why` None: it can)."""

    rank: int
    why: str | None = None
    no_shrink: str | None = None  # why the group cannot go on without it (fsdp's shards)
    spares_due: bool = False  # the pool's first spares wait for a rank able to be recovered (a script's)


@dataclass(frozen=True)
class TrainingDone:
    """A rank said `done`: training is over, no regrow any more."""


@dataclass(frozen=True)
class Ended:
    """The recovery in flight ended: the rebuilt group completed a step, or it failed."""

    recovered: bool


Event = Lost | SpareWarm | Heard | SpareNodeJoined | Done | Refused | Able | TrainingDone | Ended

# ---------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class Promote:
    """A warm spare takes lost `rank` in rebuilt group `generation` (claimed first on a multi-node
    job; `tell`: the word into the workers' store too); answer `Done` or `Refused`."""

    rank: int
    generation: int
    tell: bool = False


@dataclass(frozen=True)
class Shrink:
    """The survivors rebuild group `generation` as `ranks`, one carrying `rank`'s data slot
    (claimed, told); answer `Done` or `Refused`."""

    rank: int
    ranks: tuple[int, ...]
    generation: int


@dataclass(frozen=True)
class Regrow:
    """The warm spare takes back carried `rank`: the group rebuilds as `ranks` (claimed, told);
    answer `Done` or `Refused`."""

    rank: int
    ranks: tuple[int, ...]
    generation: int


@dataclass(frozen=True)
class Record:
    """Recovery `nth` of the attempt begins: `how` replaced | shrink | regrow | spare-node."""

    how: str
    rank: int
    nth: int
    generation: int
    node: int | None  # the node whose rank it is (None: a single-node job)
    ranks: tuple[int, ...] = ()  # shrink, regrow: the group's ranks training on
    remote: bool = False  # another node's recovery: this node's ranks are its survivors

    @property
    def replicas(self) -> int | None:
        return len(self.ranks) if self.ranks else None


@dataclass(frozen=True)
class Tell:
    """Node 0 (the workers' store's host): another node's word on group `generation`, into the store."""

    generation: int
    decision: Mapping


@dataclass(frozen=True)
class FillPool:
    """Start spares until --spares wait: `why` refill (the next failure's), regrow (for the shrunk
    group to grow back), first (a script's ranks attached: its first spares)."""

    why: str


@dataclass(frozen=True)
class GiveUp:
    """No live recovery: `why`, in words; the recovery in flight, if any (`in_flight`), failed."""

    why: str
    in_flight: bool = False


@dataclass(frozen=True)
class Warn:
    message: str


Action = Promote | Shrink | Regrow | Record | Tell | FillPool | GiveUp | Warn

# ---------------------------------------------------------------------------- state


@dataclass(frozen=True)
class Carried:
    """A rank lost to a shrink: a survivor carries its data slot."""

    node: int | None
    remote: bool = False  # another node's: that node's spares take it back
    whole_node: bool = False  # its node died whole: it comes back with a restart only


@dataclass(frozen=True)
class State:
    budget: int  # recoveries --max-restarts still allows
    recorded: int = 0  # recoveries recorded in this attempt, regrows included
    in_flight: int | None = None  # the rank of the recovery in flight
    group: tuple[int, ...] | None = None  # shrunk: the ranks training on, job-wide
    carried: Mapping[int, Carried] = field(default_factory=dict)  # never changed in place, as every mapping here
    able: Mapping[int, str | None] = field(default_factory=dict)  # rank -> None (can be recovered live) or why not
    no_shrink: Mapping[int, str] = field(default_factory=dict)  # rank -> why the group cannot go on without it
    finished: bool = False  # a rank said `done`
    joined_at: int = 0  # a spare node: the rebuilt group it joined (the groups before were formed without it)
    pending: Promote | Shrink | Regrow | None = None  # being carried out: `Done` or `Refused` answers it

    @property
    def next_generation(self) -> int:
        """The rebuilt group the next recovery forms."""
        return self.joined_at + self.recorded + 1 - (1 if self.joined_at else 0)


Result = tuple[State, tuple[Action, ...]]


def decide(state: State, event: Event, rules: Rules) -> Result:
    return _HANDLERS[type(event)](state, event, rules)


def uses_restart(how: str) -> bool:
    """A recovery uses one of --max-restarts, but a regrow: nothing failed."""
    return how != "regrow"


def restarts_used(recoveries: Iterable[Mapping]) -> int:
    """Of --max-restarts, what an attempt's recoveries (as recorded) used: each completed one by
    `uses_restart` (one that failed ended the attempt: its restart counts as such)."""
    return sum(1 for r in recoveries if r["outcome"] == "recovered" and uses_restart(r.get("action", "replaced")))


# ---------------------------------------------------------------------------- queries


def why_not(s: State, r: Rules, rank: int, survivors: tuple[int, ...] | list[int], suspect_gpu: bool = False,
            spare_ready: bool = True) -> str | None:
    """None when `rank` can be recovered live now; else the reason, in words for the user.
    `suspect_gpu`: the rank left over its own GPU (exit 8): a spare promoted into its slot would
    train on that same GPU, so only a shrink can go on without it."""
    why = _unavailable(s, r)
    if why is not None:
        return why
    if not survivors and not r.multi_node:  # multi-node: the other nodes' ranks survive
        return "every rank was lost: no survivor holds the state"
    for x in [rank, *survivors]:
        if x not in s.able and r.script:
            return f"rank {x}'s script had not called gpuherd.live.attach (a script is recovered live only through it)"
        if x not in s.able:
            return f"rank {x} had not started training yet (no state to hand over)"
        if s.able[x] is not None:
            return f"rank {x}: {s.able[x]}"
    if shrinks(s, r, suspect_gpu, spare_ready):
        return why_not_shrink(s, r, rank, survivors)
    if suspect_gpu:
        return (f"rank {rank}'s GPU is a suspect device and a warm spare takes a rank on the rank's own GPU "
                "(a spare on another GPU is not built; --min-replicas would go on without it)")
    return None


def _unavailable(s: State, r: Rules) -> str | None:
    if r.off:
        return r.off
    if s.in_flight is not None:
        return f"a second failure during a recovery (rank {s.in_flight} was being replaced)"
    if s.budget <= 0:
        return "no restart left for it (--max-restarts counts recoveries and restarts alike)"
    return None


def shrinks(s: State, r: Rules, suspect_gpu: bool = False, spare_ready: bool = True) -> bool:
    """A loss now shrinks the group: --min-replicas, and no warm spare (or shrunk already, or
    the lost rank's GPU is suspect: a spare would run on it)."""
    return r.shrink_floor > 0 and (s.group is not None or suspect_gpu or not spare_ready)


def why_not_shrink(s: State, r: Rules, rank: int, survivors: tuple[int, ...] | list[int]) -> str | None:
    """Rank 0 may be the one lost: the shrunk group's first rank (its lowest survivor) takes over
    what rank 0 did for the group (the checkpoints, the run's scalars) until a regrow brings
    rank 0 back (worker/train.py: `on_place`). Multi-node: `survivors` are this node's, the
    floor counts the job's."""
    job = [x for x in members(s, r) if x != rank] if r.multi_node else list(survivors)
    if len(job) < r.shrink_floor:
        return f"no spare left, and {len(job)} survivor(s) are fewer than --min-replicas {r.shrink_floor}"
    if rank in s.no_shrink:
        return f"no spare left, and rank {rank}: {s.no_shrink[rank]}"
    if not survivors:
        return (f"no spare left on this node (node {r.node}), and rank {rank} was its last training rank: "
                "a node's supervisor ends with its last worker (a node left empty is not built)")
    return None


def members(s: State, r: Rules) -> list[int]:
    """The ranks training now, job-wide: the shrunk group's, else every rank of the job."""
    return list(s.group) if s.group is not None else list(range(r.world_size))


def carried(s: State) -> list[int]:
    """This node's ranks whose data slots are carried (another node's are that node's to take back)."""
    return sorted(rank for rank, c in s.carried.items() if not c.remote)


def carried_elsewhere(s: State) -> dict[int, int]:
    """Multi-node: another node's carried rank -> that node (its own spares take it back)."""
    return {rank: c.node for rank, c in s.carried.items() if c.remote and c.node is not None and not c.whole_node}


def dead_nodes(s: State) -> tuple[int, ...]:
    """Multi-node: the nodes that died whole and the job went on without (their ranks stay carried)."""
    return tuple(sorted(c.node for c in s.carried.values() if c.whole_node and c.node is not None))


def regrow_candidate(s: State, asked: int | None = None) -> int | None:
    """The carried rank a warm spare takes back now (`asked`: the one an operator asked it for,
    else the lowest), or None: the group is not shrunk, a recovery is in flight, or a rank
    finished training."""
    mine = carried(s)
    if not mine or s.in_flight is not None or s.finished:
        return None
    return asked if asked in mine else min(mine)


# ---------------------------------------------------------------------------- handlers


def _lost(s: State, e: Lost, r: Rules) -> Result:
    why = why_not(s, r, e.rank, e.survivors, e.suspect_gpu, e.spare_ready)
    if why is not None:
        return _give_up(s, why)
    generation = s.next_generation
    if shrinks(s, r, e.suspect_gpu, e.spare_ready):
        ranks = [x for x in members(s, r) if x != e.rank] if r.multi_node else sorted(e.survivors)
        action: Promote | Shrink = Shrink(e.rank, tuple(ranks), generation)
    else:
        action = Promote(e.rank, generation, tell=r.shrink_floor > 0)  # the survivors wait for the word
    return replace(s, pending=action), (action,)


def _spare_warm(s: State, e: SpareWarm, r: Rules) -> Result:
    if e.rank not in carried(s):
        return s, ()  # grown back meanwhile: the spare goes back to the pool
    action = Regrow(e.rank, tuple(sorted([*(s.group or ()), e.rank])), s.next_generation)
    return replace(s, pending=action), (action,)


def _done(s: State, e: Done, r: Rules) -> Result:
    act = s.pending
    s = replace(s, pending=None)
    if isinstance(act, Promote):
        s, record = _begin(s, Record("replaced", act.rank, s.recorded + 1, act.generation, r.node))
        return s, (record, *((FillPool("refill"),) if s.budget > 0 else ()))  # a spare for the next failure
    if isinstance(act, Shrink):
        s, record = _begin(_shrunk(s, act.rank, act.ranks, Carried(r.node)),
                           Record("shrink", act.rank, s.recorded + 1, act.generation, r.node, act.ranks))
        return s, (FillPool("regrow"), record)
    s, record = _begin(_grown(s, act.rank, act.ranks),
                       Record("regrow", act.rank, s.recorded + 1, act.generation, r.node, act.ranks))
    return s, (record,)


def _refused(s: State, e: Refused, r: Rules) -> Result:
    act = s.pending
    s = replace(s, pending=None)
    if isinstance(act, Regrow):  # nothing failed: the spare waits for the next chance
        return s, (Warn(f"regrow not possible: {e.why} (warm spare pid {e.spare} was to take back rank "
                        f"{act.rank})"),)
    return _give_up(s, e.why)


def _heard(s: State, e: Heard, r: Rules) -> Result:
    """Another node's claim is this node's recovery too (its ranks the survivors), or this node
    cannot follow it (the attempt ends: a job-wide restart)."""
    c = e.claim
    if c is not None and c.node == r.node or e.generation <= s.joined_at:
        return s, ()  # this node's own claim, or one made before this spare node took its place
    why = _why_not_join(s, r, e.generation, c, e.survivors)
    if why is not None:
        lost = f"node {c.node}'s rank {c.rank}" if c else "a rank"
        return _give_up(s, f"live recovery not possible: {lost} was lost and is being replaced, but {why}; "
                           "restarting every worker")
    tell = (Tell(e.generation, c.decision),) if r.shrink_floor and c.decision is not None else ()
    if c.action == "regrow":
        s = _grown(s, c.rank, c.ranks)
    elif c.action == "shrink":
        s = _shrunk(s, c.rank, c.ranks, Carried(c.node, remote=True, whole_node=c.whole_node))
    how = c.action if c.action in ("shrink", "regrow") else "spare-node" if c.spare_node is not None else "replaced"
    s, record = _begin(s, Record(how, c.rank, s.recorded + 1, e.generation, c.node, c.ranks or (), remote=True))
    return s, (*tell, record)


def _spare_node_joined(s: State, e: SpareNodeJoined, r: Rules) -> Result:
    s, record = _begin(replace(s, joined_at=e.generation), Record("spare-node", e.rank, s.recorded + 1,
                                                                  e.generation, e.node))
    return s, (record,)


def _able(s: State, e: Able, r: Rules) -> Result:
    s = replace(s, able={**s.able, e.rank: e.why})
    if e.no_shrink:
        s = replace(s, no_shrink={**s.no_shrink, e.rank: e.no_shrink})
    return s, ((FillPool("first"),) if e.spares_due and e.why is None and s.budget > 0 else ())


def _training_done(s: State, e: TrainingDone, r: Rules) -> Result:
    return replace(s, finished=True), ()


def _ended(s: State, e: Ended, r: Rules) -> Result:
    return replace(s, in_flight=None), ()


_HANDLERS = {Lost: _lost, SpareWarm: _spare_warm, Done: _done, Refused: _refused, Heard: _heard,
             SpareNodeJoined: _spare_node_joined, Able: _able, TrainingDone: _training_done, Ended: _ended}

# ---------------------------------------------------------------------------- steps


def _begin(s: State, record: Record) -> tuple[State, Record]:
    """Recovery `record` begins, in flight until `Ended`: the only place one is counted against
    --max-restarts (`uses_restart`)."""
    return replace(s, recorded=record.nth, in_flight=record.rank,
                   budget=s.budget - (1 if uses_restart(record.how) else 0)), record


def _give_up(s: State, why: str) -> Result:
    return replace(s, in_flight=None, pending=None), (GiveUp(why, in_flight=s.in_flight is not None),)


def _shrunk(s: State, rank: int, ranks: tuple[int, ...], c: Carried) -> State:
    return replace(s, group=tuple(ranks), carried={**s.carried, rank: c})


def _grown(s: State, rank: int, ranks: tuple[int, ...]) -> State:
    """Carried rank `rank` is trained by its own process again."""
    left = {x: c for x, c in s.carried.items() if x != rank}
    return replace(s, carried=left, group=tuple(ranks) if left else None)


def _why_not_join(s: State, r: Rules, generation: int, c: Claim | None, ranks: tuple[int, ...]) -> str | None:
    if c is None:
        return f"the claim of rebuilt group {generation} on the job store is unreadable"
    if generation != s.next_generation:
        return f"this node expected rebuilt group {s.next_generation}, not {generation}"
    if c.action in ("shrink", "regrow"):
        why = _why_not_resize(s, r, c)
        if why is not None:
            return why
    if c.action == "shrink" and (sharded := [x for x in ranks if x in s.no_shrink]):
        return f"this node's rank {sharded[0]}: {s.no_shrink[sharded[0]]}"  # fsdp: a node lost whole
    if r.off or s.in_flight is not None or (s.budget <= 0 and c.action != "regrow"):
        return f"on this node: {_unavailable(s, r)}"
    for x in ranks:  # the lost rank is the other node's to judge
        if x not in s.able:
            return f"this node's rank {x} had not started training yet (no state to hand over)"
        if s.able[x] is not None:
            return f"this node's rank {x}: {s.able[x]}"
    return None


def _why_not_resize(s: State, r: Rules, c: Claim) -> str | None:
    """A shrink or regrow claim this node cannot follow: shrinking is off here, or its decision
    is not one gpuherd writes (the store has no authentication), or names a rank not carried."""
    if not r.shrink_floor:
        return "this node does not shrink (--min-replicas 0 here)"
    if c.ranks is None:
        return f"the {c.action} claimed on the job store names no group of ranks"
    if c.action == "regrow" and c.rank not in s.carried:
        return f"rank {c.rank} is not carried here"
    return None
