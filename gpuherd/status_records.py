"""Every status record type, declared once, and the one place a record line is decoded.

A worker writes records through gpuherd/status_channel.py; the supervisor decodes each
line here, once, into one of the frozen dataclasses below (or a named `Refusal`), and
every consumer `match`es on the type. The supervisor's own records in `metrics.jsonl`
(`SUPERVISOR_RECORDS`) are declared here too: the viewers read that file through the
same `decode`. docs/reference/status-records.md's field tables are generated from these
classes (scripts/reference_pages.py): the comment beside each field is its documentation.

Tolerance, as the channel always had it: a null field is not known (its default stands);
a field of the wrong type is dropped (its default stands too) and named in `refused` (a
script writes records too, and nothing it sends may take the supervisor down; the viewers
skip such a record as malformed); a field no class declares is ignored (a newer worker's
record still decodes). Only a line that is not JSON, not an object, or of a type nobody
declared is refused as a whole.

Only the standard library (and orjson where installed): the writer side imports this
module in a script's own interpreter too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any, ClassVar

try:
    import orjson
except ImportError:  # a script's own interpreter (PYTHON_EXEC)
    orjson = None  # type: ignore[assignment]

LATEST_TIME = 1e11  # unix seconds, the year 5138: a later `time` is no clock's reading


@dataclass(frozen=True, kw_only=True)
class Record:
    """What every record carries (not listed in the per-type tables)."""

    TYPE: ClassVar[str] = ""
    rank: int | None = None
    time: float | None = None
    truncated: bool = False  # the writer dropped every other field: the line would have passed PIPE_BUF
    refused: tuple[str, ...] = ()  # fields of the wrong type, dropped at decoding (their defaults stand)

    def __post_init__(self) -> None:  # built by its class (a Live or Timeline event; decoding skips this)
        if getattr(self, "event", "") is None and getattr(self, "EVENT", ""):
            object.__setattr__(self, "event", self.EVENT)


# ----------------------------------------------------------------------------- worker -> supervisor


@dataclass(frozen=True, kw_only=True)
class Ready(Record):
    """The worker is up on its device."""

    TYPE: ClassVar[str] = "ready"
    device: str | None = None  # the device as the worker sees it (`cuda:0`)
    uuid: str | None = None  # the GPU's UUID, when it has one
    pid: int | None = None  # the worker's process id


@dataclass(frozen=True, kw_only=True)
class Step(Record):
    """A logged step; without `loss` a heartbeat, sent at most every 5 s between logged steps."""

    TYPE: ClassVar[str] = "step"
    step: int | None = None  # the step just completed (0-based)
    max_steps: int | None = None  # the run's last step + 1
    loss: float | None = None  # training loss (absent on a heartbeat)
    lr: float | None = None  # learning rate
    grad_norm: float | None = None  # gradient norm before clipping
    tokens_per_s: float | None = None  # throughput of this rank since the previous logged step
    mfu: float | None = None  # model FLOPs utilisation (fraction of the device's peak)
    mem_bytes: int | None = None  # device memory in use
    carried: tuple[int, ...] = ()  # a shrunk group's carrier: the lost ranks' data slots it trains too
    carried_loss: tuple[float, ...] = ()  # a carrier: the mean loss of each slot in `carried`, in that order
    # with debug.record_samples: every micro-batch drawn, as (data slot, epoch, windows consumed
    # in it after the draw) triples, flattened; the triple names the sampler's windows exactly
    samples: tuple[int, ...] = ()
    # a script's live session (gpuherd/live/pace.py), as `alive` records carry them: since its previous `step`
    # record, the steps that ended (absent when none did)
    steps: int | None = None
    compute_s: float | None = None  # their time minus the time waiting in the gradient all-reduce
    wait_s: float | None = None  # their time waiting in the gradient all-reduce


@dataclass(frozen=True, kw_only=True)
class Eval(Record):
    """A validation result."""

    TYPE: ClassVar[str] = "eval"
    step: int | None = None  # the step it was taken at
    val_loss: float | None = None  # validation loss


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Record):
    """A checkpoint published ([Checkpoints](../design/checkpoints.md))."""

    TYPE: ClassVar[str] = "checkpoint"
    step: int | None = None  # the step it holds
    path: str | None = None  # where it was published
    stall_s: float | None = None  # seconds the training loop was blocked
    wait_s: float | None = None  # of those, seconds waiting for the previous background write
    write_s: float | None = None  # seconds the write took
    write_cpu_s: float | None = None  # CPU seconds (user + system) the write took: the writer's, or the loop's when blocking
    mode: str | None = None  # `async` | `blocking`


@dataclass(frozen=True, kw_only=True)
class CheckpointWrite(Record):
    """A checkpoint write in the background; `accounted`: what a save (async or blocking) cost the
    loop in all, measured on its step times once its write ended (docs/design/checkpoints.md)."""

    TYPE: ClassVar[str] = "checkpoint_write"
    state: str | None = None  # `started` | `failed` | `accounted`
    step: int | None = None  # the step it holds
    path: str | None = None  # where it is written
    cost_s: float | None = None  # accounted: the save's whole cost to the loop (its window less the steps in it)
    steps: int | None = None  # accounted: the steps its window held


@dataclass(frozen=True, kw_only=True)
class ScriptSave(Record):
    """A save a `--script` made, as gpuherd saw it: a `torch.save` or `torch.distributed.checkpoint.save`
    that completed (the script bootstrap), or a framework's checkpoint (gpuherd/integrations/)."""

    TYPE: ClassVar[str] = "script_save"
    step: int | None = None  # the steps completed when it was taken (the bootstrap: optimizer steps of this attempt)
    path: str | None = None  # the file torch.save was given, DCP's checkpoint_id, the framework's path; null: not a path
    api: str | None = None  # `torch.save` | `dcp.save` | `lightning` | `transformers`
    seconds: float | None = None  # how long the save took


@dataclass(frozen=True, kw_only=True)
class Phase(Record):
    """Where the loop is; `rendezvous` comes right before process-group init."""

    TYPE: ClassVar[str] = "phase"
    name: str | None = None  # `init`, `rendezvous`, `compile`, `train`, `eval`, `checkpoint`, `sdc`, `shutdown`


@dataclass(frozen=True, kw_only=True)
class SuspiciousStep(Record):
    """What `nan` and `spike` share ([Suspicious steps](../design/suspicious-steps.md))."""

    step: int | None = None  # the step it happened at
    kind: str | None = None  # `nonfinite` | `loss_spike` | `grad_norm_spike`
    action: str | None = None  # `stop` | `skip` | `retried`
    classification: str | None = None  # null, or `transient` | `reproducible` under policy rerun
    loss: float | str | None = None  # the step's loss (a non-finite value as a string)
    grad_norm: float | str | None = None  # its gradient norm (a non-finite value as a string)
    ranks: tuple[int, ...] = ()  # stop/skip/reproducible: the ranks it was seen on (at most 64)
    n_ranks: int | None = None  # stop/skip/reproducible: how many ranks saw it
    report: str | None = None  # stop/skip/reproducible: the report file
    checkpoint: str | None = None  # stop/skip/reproducible: the checkpoint to look at it from
    culprits: tuple[int, ...] = ()  # transient: the ranks blamed (empty when they could not be told)
    replay_loss: float | str | None = None  # transient: the replayed step's loss
    replay_grad_norm: float | str | None = None  # transient: the replayed step's gradient norm


@dataclass(frozen=True, kw_only=True)
class Nan(SuspiciousStep):
    """A suspicious step: a non-finite loss or gradient ([Suspicious steps](../design/suspicious-steps.md))."""

    TYPE: ClassVar[str] = "nan"


@dataclass(frozen=True, kw_only=True)
class Spike(SuspiciousStep):
    """A suspicious step: a loss or gradient-norm spike; the fields of `nan`, and two more."""

    TYPE: ClassVar[str] = "spike"
    metric: str | None = None  # the spiking metric
    threshold: float | None = None  # the value it passed


@dataclass(frozen=True, kw_only=True)
class Suspect(Record):
    """Sent by each rank blamed for a transient fault or a silent data corruption."""

    TYPE: ClassVar[str] = "suspect"
    step: int | None = None  # the step of the fault
    device: str | None = None  # the rank's own label of its device (`cuda:0` under isolation)
    host: str | None = None  # the rank's host name
    transient_faults: int | None = None  # its count of transient faults in this attempt
    limit: int | None = None  # debug.max_transient_faults
    stopping: bool = False  # true: exit 8 follows
    cause: str | None = None  # `silent data corruption` when replicas disagreed; absent: a transient fault


@dataclass(frozen=True, kw_only=True)
class Sdc(Record):
    """Replicas disagreed and the culprits were named and healed; sent once, by the lowest healthy
    rank (docs/guide/silent-data-corruption.md)."""

    TYPE: ClassVar[str] = "sdc"
    step: int | None = None  # the step after which the replicas disagreed (0-based)
    culprits: tuple[int, ...] = ()  # the ranks named
    blamed_by: str | None = None  # `majority` | `recompute`
    healed: str | None = None  # how the culprits were healed
    evidence: tuple[str, ...] = ()  # at most 4 lines: bucket, value and bit
    seconds: float | None = None  # detection, blame and heal


@dataclass(frozen=True, kw_only=True)
class Error(Record):
    """The worker fails with a known cause."""

    TYPE: ClassVar[str] = "error"
    message: str | None = None  # what failed (at most 2,000 characters)
    exit_code: int | None = None  # the exit code it ends with


@dataclass(frozen=True, kw_only=True)
class Done(Record):
    """The worker finished training."""

    TYPE: ClassVar[str] = "done"
    step: int | None = None  # its last step


@dataclass(frozen=True, kw_only=True)
class Alive(Record):
    """Liveness, every second, from a thread of its own (gpuherd/liveness.py)."""

    TYPE: ClassVar[str] = "alive"
    # `step`, `eval`, `checkpoint` (timed), `between steps`, or an untimed one: `init`, `rendezvous`, `compile`,
    # `shutdown`
    phase: str = "unknown"
    step: int | None = None  # the step the loop is in (or last was in); null before the first
    for_s: float = 0.0  # seconds in this phase instance (this step, this eval)
    # what the loop does inside the phase (`data loading`, `forward/backward`, `optimizer step`, or a collective's
    # name such as `all_reduce (gradients)`, `all_reduce (stop vote)`)
    where: str = ""
    where_s: float = 0.0  # seconds in `where`
    collective: bool = False  # true while the loop waits for the other ranks in `where`
    # since the previous `alive`: `{phase: [count, longest seconds]}` of the step/eval/checkpoint instances that
    # ended (absent when none did)
    took: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    steps: int | None = None  # since the previous `alive`: steps that ended (absent when none did)
    compute_s: float | None = None  # their time minus the time waiting in collectives
    wait_s: float | None = None  # their time waiting in collectives


@dataclass(frozen=True, kw_only=True)
class Stop(Record):
    """A stop signal reached the worker itself; the supervisor stops every worker as if it had got that signal."""

    TYPE: ClassVar[str] = "stop"
    signal: str | None = None  # the signal's name (`SIGTERM`)


@dataclass(frozen=True, kw_only=True)
class Live(Record):
    """[Live recovery](../design/live-recovery.md): one class per `event`; an unknown event decodes to this one."""

    TYPE: ClassVar[str] = "live"
    EVENT: ClassVar[str] = ""
    event: str | None = None  # which of the live-recovery events below


@dataclass(frozen=True, kw_only=True)
class LiveAble(Live):
    """Whether a lost peer of this rank can be replaced live."""

    EVENT: ClassVar[str] = "able"
    able: bool = False  # true: a spare can take a lost peer's place
    why: str | None = None  # why not, when it cannot
    no_shrink: str | None = None  # why the group cannot go on without this rank (--min-replicas); None: it can


@dataclass(frozen=True, kw_only=True)
class LiveLostPeer(Live):
    """A collective broke: a peer was lost."""

    EVENT: ClassVar[str] = "lost_peer"
    generation: int | None = None  # the rebuilt group this rank joins next (1, 2, ...)
    step: int | None = None  # completed steps when the collective broke


@dataclass(frozen=True, kw_only=True)
class LiveRejoined(Live):
    """The group was rebuilt and this rank is in it."""

    EVENT: ClassVar[str] = "rejoined"
    generation: int | None = None  # the rebuilt group
    step: int | None = None  # the step the group resumed at
    source: int | None = None  # the rank whose state the newcomer took
    role: str | None = None  # `newcomer` | `source` | `survivor`
    seconds: float | None = None  # this rank's join and state transfer
    replicas: int | None = None  # the processes in the rebuilt group (fewer than the ranks after a shrink)
    slots: tuple[int, ...] = ()  # the data slots this rank trains (its own, and a lost rank's it carries)


@dataclass(frozen=True, kw_only=True)
class LiveWarm(Live):
    """A warm spare's warm-up ended (its pool reads it before the spare holds a rank; rank is a placeholder)."""

    EVENT: ClassVar[str] = "warm"


@dataclass(frozen=True, kw_only=True)
class LiveFirstStep(Live):
    """The newcomer's first completed step."""

    EVENT: ClassVar[str] = "first_step"
    generation: int | None = None  # the rebuilt group
    step: int | None = None  # the step it completed


LIVE_EVENTS: tuple[type[Live], ...] = (LiveAble, LiveLostPeer, LiveRejoined, LiveFirstStep, LiveWarm)

# The status channel's types, in the order the reference lists them; `StatusWriter.send` accepts these.
STATUS_RECORDS: tuple[type[Record], ...] = (Ready, Step, Eval, Checkpoint, CheckpointWrite, ScriptSave, Phase, Nan,
                                            Spike, Suspect, Sdc, Done, Error, Alive, Stop, Live)


# ----------------------------------------------------------------------------- the supervisor's own, in metrics.jsonl


@dataclass(frozen=True, kw_only=True)
class Timeline(Record):
    """What the workers cannot say (supervisor/goodput/marks.py): one class per `event`."""

    TYPE: ClassVar[str] = "timeline"
    EVENT: ClassVar[str] = ""
    event: str | None = None  # which of the timeline events below


@dataclass(frozen=True, kw_only=True)
class TimelineStart(Timeline):
    """A start of the supervisor: the first, or a SLURM requeue continuing the run."""

    EVENT: ClassVar[str] = "start"
    start: int | None = None  # 1, 2, ...: which start of the run
    dataset_s: float | None = None  # seconds the dataset build took before it


@dataclass(frozen=True, kw_only=True)
class TimelineAttempt(Timeline):
    """An attempt's workers were spawned."""

    EVENT: ClassVar[str] = "attempt"
    attempt: int | None = None  # its number
    resumed: bool = False  # from a checkpoint
    script: bool = False  # a `--script` run's: its saves are the `script_save` records


@dataclass(frozen=True, kw_only=True)
class TimelineAttemptEnd(Timeline):
    """An attempt ended."""

    EVENT: ClassVar[str] = "attempt_end"
    attempt: int | None = None  # its number
    outcome: str | None = None  # the root cause's kind (null: success)
    failed_at: float | None = None  # when its failure was known (null: not a failure)


@dataclass(frozen=True, kw_only=True)
class TimelineProc(Timeline):
    """A rank's process entered or left state T (stopped)."""

    EVENT: ClassVar[str] = "proc"
    state: str | None = None  # the state letter it entered


@dataclass(frozen=True, kw_only=True)
class TimelineStraggler(Timeline):
    """A named straggler's slow stretch ended (back to pace, moved out, or the attempt's end)."""

    EVENT: ClassVar[str] = "straggler"
    since: float | None = None  # when its stretch began (wall clock)
    lost_s: float | None = None  # the job's seconds that went to its pace (goodput: `straggler`)
    moved: bool = False  # it ended by a move-out (a live recovery)
    node: int | None = None  # a whole node's stretch (judged on node 0; `rank` null)


TIMELINE_EVENTS: tuple[type[Timeline], ...] = (TimelineStart, TimelineAttempt, TimelineAttemptEnd, TimelineProc,
                                               TimelineStraggler)


@dataclass(frozen=True, kw_only=True)
class Restart(Record):
    """A restart of the job (a new attempt)."""

    TYPE: ClassVar[str] = "restart"
    attempt: int | None = None  # the attempt it starts
    after: str | None = None  # the root cause's message
    exit_code: int | None = None  # the root cause's exit code
    resume: str | None = None  # the checkpoint it resumes from
    membership: bool = False  # a change of membership, not a failure
    restarts_used: int | None = None  # of system.max_restarts
    excluded_gpus: tuple[int, ...] = ()  # suspect GPUs left out from now on
    world_size: int | None = None  # the new attempt's
    script_save: str | None = None  # a --script: the last save gpuherd saw in the attempt before, in words (or none)


NODE_MOVED_OUT = "node-straggler"  # a Recovery's `kind` when a straggler node was moved out to a spare node


@dataclass(frozen=True, kw_only=True)
class Recovery(Record):
    """A live recovery began or ended (supervisor/processes/live_recovery.py)."""

    TYPE: ClassVar[str] = "recovery"
    number: int | None = None  # 1, 2, ... in this run
    attempt: int | None = None  # the attempt it happened in
    node: int | None = None  # a multi-node job: the node whose rank was lost (null on one node)
    device: str | None = None  # the lost rank's device
    failed: str | None = None  # what happened to the lost rank
    kind: str | None = None  # `worker-exit` | `hang` | `straggler` | `regrow` (a warm spare took back a carried rank)
    #   | `node` (a node died whole) | `node-straggler` (a straggler node moved out to a spare node)
    outcome: str | None = None  # `in progress` | `recovered` | `failed`
    lost_pid: int | None = None  # the lost rank's process
    replaced_by_pid: int | None = None  # the spare that took its place
    resumed_step: int | None = None  # completed steps the rebuilt group continued from
    source_rank: int | None = None  # the survivor whose state the newcomer took
    steps_redone: int | None = None  # completed steps trained again
    seconds: float | None = None  # death -> the newcomer's first completed step
    rejoin_s: float | None = None  # the newcomer's own join and state transfer
    action: str | None = None  # `replaced` (by a warm spare) | `shrink` (no spare left: the survivors went on) | `regrow`
    #                            | `spare-node` (a node died whole: a spare node took its ranks)
    replicas: int | None = None  # a shrink or a regrow: the processes training on
    shrunk_s: float | None = None  # a regrow: how long the rank's data slot was carried (its shrink -> the regrow)
    spare_node: int | None = None  # `spare-node`: a node died whole; the --node-rank of the spare node that took its ranks


@dataclass(frozen=True, kw_only=True)
class GpuEvent(Record):
    """An XID or double-bit ECC event the driver reported."""

    TYPE: ClassVar[str] = "gpu_event"
    gpu: int | None = None  # the GPU's index
    event: str | None = None  # `xid` | `double_bit_ecc`
    data: int | None = None  # the XID


@dataclass(frozen=True, kw_only=True)
class Host(Record):
    """A worker process's host sample."""

    TYPE: ClassVar[str] = "host"
    pid: int | None = None  # the worker's process
    cpu_percent: float | None = None  # of one core
    rss: float | None = None  # resident memory, bytes
    threads: int | None = None  # its threads


@dataclass(frozen=True, kw_only=True)
class Gpu(Record):
    """A GPU sample (supervisor/gpus/monitor.py); "N/A" where the driver cannot say."""

    TYPE: ClassVar[str] = "gpu"
    gpu: int | None = None  # the GPU's index
    uuid: str | None = None  # its UUID
    util: float | str | None = None  # utilisation, percent
    mem_used: float | str | None = None  # bytes
    mem_total: float | str | None = None  # bytes
    temp: float | str | None = None  # degrees C
    temp_slowdown: float | str | None = None  # the temperature it slows down at
    sm_clock_mhz: float | str | None = None  # SM clock
    power_w: float | str | None = None  # power draw
    power_limit_w: float | str | None = None  # enforced power limit
    clock_events: tuple[str, ...] | str | None = None  # why its clocks are held back
    ecc_corrected: float | str | None = None  # corrected ECC errors since boot
    ecc_uncorrected: float | str | None = None  # uncorrected ECC errors since boot


@dataclass(frozen=True, kw_only=True)
class Straggler(Record):
    """A rank computing slower than the others (supervisor/health/stragglers.py), or a whole node
    slower than the other nodes (supervisor/health/node_stragglers.py: `node` set, `rank` null)."""

    TYPE: ClassVar[str] = "straggler"
    slowdown: float | None = None  # its compute time / the other ranks' (nodes') median
    compute_ms: float | None = None  # its compute time per step (a node's: the median of its ranks')
    others_ms: float | None = None  # the other ranks' (nodes') median
    windows: int | None = None  # windows in a row it was slow in
    reason: str | None = None  # the likely reason, from the GPU/host samples
    node: int | None = None  # a whole node slower than the others (multi-node, judged on node 0)
    moved_out: bool = False  # that node was told to leave, a spare node taking its place
    held_s: float | None = None  # ... after this long over the move-out factor
    compute_ms_before: dict[str, float] | None = None  # ... each node's pace then ({"node": ms})
    compute_ms_after: dict[str, float] | None = None  # ... and once the new node's second window closed


SUPERVISOR_RECORDS: tuple[type[Record], ...] = (Timeline, Restart, Recovery, GpuEvent, Host, Gpu, Straggler)


# ----------------------------------------------------------------------------- decoding


class Refused(enum.Enum):
    """Why a line is no record at all."""

    UNREADABLE = "not JSON"
    NOT_AN_OBJECT = "not a JSON object"
    UNKNOWN_TYPE = "a type no record class declares"
    MALFORMED_FIELD = "a field of the wrong type"  # where a consumer takes a record whole or not at all (viewers)


@dataclass(frozen=True)
class Refusal:
    why: Refused
    detail: str | None = None  # the unknown type's name (UNKNOWN_TYPE), the fields (MALFORMED_FIELD)

    def __str__(self) -> str:
        return f"{self.why.value}" + (f" ({self.detail})" if self.detail is not None else "")


class _Bad(Exception):
    """A field's value does not fit its declared type."""


def _int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise _Bad


def _float(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise _Bad


def _str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise _Bad


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise _Bad


def _float_or_text(v: Any) -> float | str:
    return v if isinstance(v, str) else _float(v)


def _tuple_of(item: Any) -> Any:
    def convert(v: Any) -> tuple:
        if not isinstance(v, list):
            raise _Bad
        return tuple(item(x) for x in v)
    return convert


def _per_key(v: Any) -> dict[str, float]:
    """`{"node or rank": milliseconds}`: an entry of another shape is dropped alone."""
    if not isinstance(v, dict):
        raise _Bad
    out = {}
    for key, ms in v.items():
        try:
            out[str(key)] = _float(ms)
        except _Bad:
            continue
    return out


def _took(v: Any) -> dict[str, tuple[int, float]]:
    """`{phase: [count, longest]}`: entries of another shape are dropped one by one."""
    if not isinstance(v, dict):
        raise _Bad
    out = {}
    for phase, pair in v.items():
        try:
            if isinstance(pair, list) and len(pair) == 2:
                out[str(phase)] = (int(_float(pair[0])), _float(pair[1]))
        except _Bad:
            continue
    if len(out) < len(v):
        raise _Bad(out)  # the good entries stand, the field is still named as refused
    return out


def _or_none(convert: Any) -> Any:
    return lambda v: None if v is None else convert(v)


# The declared annotations -> their converters: a field of a shape not here fails at import (KeyError),
# never at the first record that carries it.
_CONVERT: dict[str, Any] = {
    "int | None": _or_none(_int), "float | None": _or_none(_float), "str | None": _or_none(_str),
    "bool": _bool, "str": _str, "float": _float, "float | str | None": _or_none(_float_or_text),
    "tuple[int, ...]": _tuple_of(_int), "tuple[str, ...]": _tuple_of(_str), "tuple[float, ...]": _tuple_of(_float),
    "tuple[str, ...] | str | None": _or_none(lambda v: v if isinstance(v, str) else _tuple_of(_str)(v)),
    "dict[str, tuple[int, float]]": _took, "dict[str, float] | None": _or_none(_per_key),
}
_HEADER = {"rank": "int | None", "time": "float | None", "truncated": "bool"}  # `time` is range-checked too
# Values whose exact type each annotation takes as it is (the common case, no call): a record
# of a viewer's file is one of hundreds of thousands.
_AS_IS: dict[str, frozenset[type]] = {
    "int | None": frozenset({int, type(None)}), "float | None": frozenset({float, type(None)}),
    "str | None": frozenset({str, type(None)}), "bool": frozenset({bool}), "str": frozenset({str}),
    "float": frozenset({float}), "float | str | None": frozenset({float, str, type(None)}),
}


@dataclass(frozen=True)
class _Shape:
    """How one record class is decoded: per field the exact types taken as they are (the common
    case: one set lookup), the converter for the rest, and the values of fields a line leaves out."""

    accept: dict[str, frozenset[type]]
    convert: dict[str, tuple[bool, Any]]  # name -> (an int is made a float, converter)
    defaults: dict[str, Any]
    factories: dict[str, Any]


def _shape(cls: type[Record]) -> _Shape:
    accept, convert, defaults, factories = {}, {}, {}, {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            defaults[f.name] = f.default
        else:
            factories[f.name] = f.default_factory
        if f.name == "refused":
            continue
        annotation = _HEADER.get(f.name, f.type)
        as_is = _AS_IS.get(annotation, frozenset())  # type: ignore[arg-type]
        if f.default is not None:  # null leaves the default: never stored in its place
            as_is = as_is - {type(None)}
        accept[f.name] = as_is
        convert[f.name] = (annotation.startswith("float"), _CONVERT[annotation])  # type: ignore[union-attr,index]
    return _Shape(accept, convert, defaults, factories)


def _convert(shape: _Shape, key: str, value: Any, values: dict[str, Any], refused: list[str]) -> None:
    """A field whose value's type is not simply taken: null, an int for a float, or a shape to check."""
    if value is None:  # not known: its absent value stands
        return
    to_float, convert = shape.convert[key]
    if to_float and type(value) is int:  # JSON has one kind of number
        values[key] = float(value)
        return
    try:
        values[key] = convert(value)
    except _Bad as bad:
        refused.append(key)
        if bad.args:  # what could be kept of it
            values[key] = bad.args[0]


_STATUS: dict[str, type[Record]] = {cls.TYPE: cls for cls in STATUS_RECORDS}
_ALL: dict[str, type[Record]] = {**_STATUS, **{cls.TYPE: cls for cls in SUPERVISOR_RECORDS}}
_BY_EVENT: dict[type[Record], dict[str, type[Record]]] = {
    Live: {cls.EVENT: cls for cls in LIVE_EVENTS}, Timeline: {cls.EVENT: cls for cls in TIMELINE_EVENTS}}
_SHAPES = {cls: _shape(cls) for cls in {*_ALL.values(), *LIVE_EVENTS, *TIMELINE_EVENTS}}
RECORD_TYPES: tuple[str, ...] = tuple(_STATUS)


def fields_of(cls: type[Record]) -> list[dataclasses.Field]:
    """A record type's own fields (the reference tables), without what every record carries."""
    header = {f.name for f in dataclasses.fields(Record)}
    return [f for f in dataclasses.fields(cls) if f.name not in header]


def from_object(obj: Any, supervisor: bool = False) -> Record | Refusal:
    """A parsed JSON value -> its record. `supervisor`: the supervisor's own types are known too
    (metrics.jsonl); a worker's pipe carries only the status channel's."""
    if not isinstance(obj, dict):
        return Refusal(Refused.NOT_AN_OBJECT)
    name = obj.get("type")
    cls = (_ALL if supervisor else _STATUS).get(name) if isinstance(name, str) else None
    if cls is None:
        return Refusal(Refused.UNKNOWN_TYPE, str(name))
    by_event = _BY_EVENT.get(cls)
    if by_event is not None:
        cls = by_event.get(obj.get("event"), cls)  # type: ignore[arg-type]
    shape = _SHAPES[cls]
    values = shape.defaults.copy()
    for name, make in shape.factories.items():
        values[name] = make()
    refused: list[str] = []
    accept = shape.accept
    for key, value in obj.items():
        taken = accept.get(key)
        if taken is None:  # `type`, or a field no class declares (a newer writer's): ignored
            continue
        if type(value) in taken:
            values[key] = value
        else:
            _convert(shape, key, value, values, refused)
    when = values["time"]
    if when is not None and not 0 <= when < LATEST_TIME:  # no clock reads that
        values["time"] = None
        refused.append("time")
    values["refused"] = tuple(refused)
    # The values are checked: set them as the instance's own, without the frozen __init__'s
    # object.__setattr__ per field (it would cost three times the parsing of the line).
    record = object.__new__(cls)
    record.__dict__.update(values)
    return record


def decode(line: bytes, supervisor: bool = False) -> Record | Refusal:
    """One line -> its record, or the refusal that says why it is none."""
    try:
        obj = orjson.loads(line) if orjson is not None else json.loads(line)
    except ValueError:  # orjson.JSONDecodeError and json's are both ValueErrors
        return Refusal(Refused.UNREADABLE)
    return from_object(obj, supervisor)



def to_object(record: Record) -> dict[str, Any]:
    """A record as its line's JSON object, the inverse of `from_object`: `type` (and `event`),
    then every field, without the header's unknowns (a null rank or time) and its decoding marks
    (`truncated`, `refused`). The supervisor writes its own records through this."""
    kind = type(record)
    out: dict[str, Any] = {"type": kind.TYPE}
    event = getattr(kind, "EVENT", "")
    if event:
        out["event"] = event
    for field in dataclasses.fields(record):
        name, value = field.name, getattr(record, field.name)
        if (name in ("rank", "time") and value is None) or name in ("truncated", "refused") or (
                name == "event" and event):
            continue
        out[name] = list(value) if isinstance(value, tuple) else value
    return out
