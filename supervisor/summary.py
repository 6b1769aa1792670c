"""How a run ended, for the user (root-cause block on the console) and for tools (summary.json)."""

from __future__ import annotations

import datetime
import enum
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from gpuherd.exit_codes import ExitCode, describe
from gpuherd.files import write_bytes_atomic
from gpuherd.text import printable_tree
from supervisor.goodput import Goodput, console_line

RULE = "=" * 80


def shell_code(returncode: int) -> int:
    """subprocess's -N (killed by signal N) -> the shell's 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def how_it_ended(returncode: int | None, script: bool = False) -> str:
    """`script`: a user's script exited, whose codes are its own (no gpuherd label)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == 0 or (script and returncode <= 128):
        return f"exit code {returncode}"
    return f"exit code {returncode} ({describe(returncode)})"


class CauseKind(enum.StrEnum):
    """What kind of event ended an attempt (summary.json's `root_cause.kind`, an attempt's `outcome`)."""

    WORKER_EXIT = "worker-exit"  # a worker failed
    EARLY_EXIT = "early-exit"  # a worker left cleanly while the others hung on it
    HANG = "hang"  # no progress, by the evidence
    RENDEZVOUS = "rendezvous"  # the process group never formed
    WATCHER = "watcher"  # a run watcher (the GPU watch) found the run cannot go on
    INTERRUPTED = "interrupted"  # Ctrl-C
    TERMINATED = "terminated"  # a stop signal (scancel, a preemption, a worker's own)
    SUPERVISOR = "supervisor"  # the supervisor itself could not go on
    NODE = "node"  # multi-node: another node failed or was lost
    STORE = "store"  # multi-node: the rendezvous store failed
    MEMBERSHIP = "membership"  # an elastic job's membership changed: nobody's failure
    DATASET = "dataset"  # the dataset cache is missing or damaged
    STRAGGLER = "straggler"  # a rank too slow for too long, moved out live (supervisor/health/straggler_moves.py)


def moved_out_line(rec: dict[str, Any]) -> str:
    """A straggler's move-out (a recovery's `straggler` evidence), for the summary and `gpuherd report`."""
    ev = rec["straggler"]
    after = (f", {ev['step_s_after']:.3f} s after" if ev.get("step_s_after") is not None else
             ", no straggler window closed after it")
    return (f"straggler rank {rec['rank']} moved out ({ev['slowdown']:.2f}x the others' compute for "
            f"{ev['held_s']:.0f} s): job step {ev['step_s_before']:.3f} s at its pace{after}; "
            f"{ev.get('saved_s') or 0.0:.1f} s saved so far")


@dataclass(frozen=True)
class RootCause:
    """Immutable once built (the supervision policy holds it in its frozen state): a change is a
    `dataclasses.replace`, never an assignment; its lists are never appended to either. The facts
    a decision needs are fields (`kind`, `signal`, `preempted`, `node`, `rank`): `message` is for
    people, and no code reads a fact back out of it."""

    kind: CauseKind  # a plain string is taken too, and checked (one of CauseKind's values)
    exit_code: int  # what the supervisor exits with
    message: str  # one line
    rank: int | None = None  # global rank
    device: str | None = None  # GPU3 / CPU0
    stderr_tail: list[str] = field(default_factory=list)
    node: int | None = None  # multi-node: the node it happened on
    host: str | None = None
    traceback: list[str] = field(default_factory=list)  # from the rank's error file (torch's @record)
    script_code: bool = False  # exit_code is a user script's own: no gpuherd label for it
    evidence: list[str] = field(default_factory=list)  # a hang: one line per rank, blamed first; collective traces
    signal: str | None = None  # a stop: the signal's name (`SIGTERM`), whoever received it
    slurm_stop: bool = False  # SLURM stopped the whole job (the same words on every node, no node named)
    preempted: bool = False  # ... for a preemption (node 0 asks SLURM for the requeue)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CauseKind(self.kind))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RootCause:
        keys = ("kind", "exit_code", "message", "rank", "device", "node", "host", "signal")
        return cls(**{k: d.get(k) for k in keys}, stderr_tail=list(d.get("stderr_tail") or []),
                   traceback=list(d.get("traceback") or []), script_code=bool(d.get("script_code")),
                   evidence=list(d.get("evidence") or []), slurm_stop=bool(d.get("slurm_stop")),
                   preempted=bool(d.get("preempted")))


@dataclass
class WorkerReport:
    rank: int
    device: str
    pid: int
    exit_code: int | None  # shell convention (128+N for signal N)
    ended: str  # "exit code 1 (failure)", "killed by SIGTERM"
    role: str  # ok | first-failure | victim | interrupted | running
    signals_sent: list[str]
    last_step: int | None
    phase: str | None
    status_records: int
    seconds: float | None  # alive for
    log: str


SDC_CAUSE = "silent data corruption"  # a suspect's cause when replicas disagreed (worker/sdc/)
STRAGGLER_CAUSE = "straggler"  # a suspect's cause when its rank was moved out for its pace (health/straggler_moves.py)


@dataclass
class SuspectDevice:
    """A device its rank blamed for transient faults (`suspect` status records; the latest one
    of each rank in an attempt), mapped to the physical GPU through the attempt's device plan."""

    attempt: int
    rank: int  # global rank
    device: str  # the label the rank sent: "cuda:0 (GPU 3)", "cpu"
    gpu: int | None  # physical GPU id (nvidia-smi's), None for a CPU worker
    host: str
    transient_faults: int  # in this attempt
    limit: int  # debug.max_transient_faults
    step: int | None  # of the last transient fault
    then: str = ""  # what came of it: "excluded from attempt 2", a hint, or nothing
    cause: str = "transient fault"  # or "silent data corruption": replicas that disagreed (worker/sdc/)
    slot: int | None = None  # the plan's device id: the GPU index, or the CPU worker's slot
    uuid: str = ""  # the GPU's NVML UUID ("" for a CPU worker, or unknown)
    evidence: list[str] = field(default_factory=list)  # silent data corruption: bucket, value and bit
    steps: list[int] = field(default_factory=list)  # every step it was blamed at in the attempt

    @property
    def over_limit(self) -> bool:
        """More transient faults than allowed: the device that stopped the attempt with exit 8."""
        return self.transient_faults > self.limit

    def line(self, name_attempt: bool = False) -> str:
        where = f"GPU {self.gpu}" if self.gpu is not None else self.device
        attempt = f", attempt {self.attempt}" if name_attempt else ""
        what = (f"a straggler moved out ({'; '.join(self.evidence) or 'too slow for too long'})"
                if self.cause == STRAGGLER_CAUSE else
                f"{self.transient_faults} {self.cause}(s), limit {self.limit}, last at step {self.step}")
        return (f"suspect device: {where} (host {self.host}, rank {self.rank}{attempt}): {what}"
                + (f" — {self.then}" if self.then else ""))


@dataclass
class AttemptReport:
    """One start of every worker (`--max-restarts`: the first attempt is 0)."""

    attempt: int
    started_at: str
    duration_s: float
    exit_code: int
    outcome: str  # "success" or the root cause's kind
    root_cause: RootCause | None
    resumed_from: str | None  # the checkpoint handed to the workers (GPUHERD_RESUME), None: as configured
    log_dir: str  # where this attempt's worker logs are
    teardown_s: float | None
    workers: list[WorkerReport]
    not_restarted: str | None = None  # why a failed attempt ended the run (restarts left or not)
    stop_signal: str | None = None  # the supervisor received this (SIGINT/SIGTERM/SIGHUP/...) during the attempt
    final_save: str | None = None  # a graceful stop's last checkpoint: "saved", "not saved", None: nothing said
    # a --script: the run's last save gpuherd saw by the attempt's end (rank, step, path, api, attempt, before_s:
    # before the failure, last_step: that rank's last step reported; none of them when it saw none) and `said`, in
    # words; None: not a script
    script_saves: dict[str, Any] | None = None
    suspect_devices: list[SuspectDevice] = field(default_factory=list)
    excluded_gpus: list[int] = field(default_factory=list)  # suspect GPUs this attempt ran without
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # live recoveries (processes/live_recovery.py)


@dataclass
class Summary:
    run_id: str
    run_dir: str
    mode: str  # "train" | "script"
    command: list[str]
    exit_code: int
    outcome: str
    started_at: str
    duration_s: float
    root_cause: RootCause | None
    workers: list[WorkerReport]
    teardown_s: float | None = None  # first failure -> last worker gone
    notes: list[str] = field(default_factory=list)
    max_restarts: int = 0
    restarts: int = 0  # failures restarted (an elastic job's membership restarts are attempts, not these)
    attempts: list[AttemptReport] = field(default_factory=list)  # every start, oldest first
    node_rank: int = 0  # multi-node: this node
    nnodes: int = 1
    nodes: list[dict[str, Any]] = field(default_factory=list)  # every node: host, nproc, first_rank, run_dir
    final_save: str | None = None  # the last attempt's (a graceful stop): "saved" | "not saved" | None
    stragglers: list[dict[str, Any]] = field(default_factory=list)  # every straggler warning (health/stragglers.py)
    hang_timeouts: dict[str, float] = field(default_factory=dict)  # learned allowance per phase, seconds
    suspect_devices: list[SuspectDevice] = field(default_factory=list)  # every attempt's, oldest first
    slurm_job_id: str | None = None  # --slurm: this start's job
    start: int = 0  # the run's starts before this one (a SLURM job requeued or resubmitted: supervisor/requeue.py)
    slurm_restart_count: int = 0  # SLURM requeued the job this often before this start
    requeues: list[dict[str, Any]] = field(default_factory=list)  # the run's earlier starts, oldest first
    node_outcomes: list[dict[str, Any]] = field(default_factory=list)  # node 0 of a multi-node job: every node's end
    # every live recovery: a lost rank replaced by a warm spare, the others kept (each uses one of max_restarts)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    # the whole run's goodput, every start's (supervisor/goodput): ratio, wall_s, productive_s, badput_s
    goodput: dict[str, Any] | None = None

    def to_json(self) -> bytes:
        # printable_tree: a message may quote a file name with non-UTF-8 bytes; the summary is written anyway
        return orjson.dumps(printable_tree(asdict(self)), option=orjson.OPT_INDENT_2)

    def write(self, path: Path) -> None:
        write_bytes_atomic(path, self.to_json() + b"\n")

    def block(self) -> str:
        """The console's root-cause block (or the one-line success note)."""
        if self.root_cause is None:
            done = [f"{n} {what}" for n, what in ((self.restarts, "restart(s)"), (self._recovered(), "live recovery(ies)"),
                                                  (self._recovered("regrow"), "regrow(s)")) if n]
            after = f" after {' and '.join(done)}" if done else ""
            ok = sum(1 for w in self.workers if w.exit_code == 0)  # a shrunk group's lost rank did not
            lines = [f"gpuherd: run {self.run_id} finished: {ok} worker(s) exited 0 in "
                     f"{self.duration_s:.1f} s{after}; logs in {self.run_dir}"]
            lines += [d.line(name_attempt=self.max_restarts > 0) for d in self.suspect_devices]
            return "\n".join(lines + self._recovery_lines() + self._attempt_lines() + self._straggler_lines()
                             + self._goodput_lines() + [f"note: {n}" for n in self.notes] + self._node_lines())
        rc = self.root_cause
        if rc.kind in (CauseKind.TERMINATED, CauseKind.INTERRUPTED) and self.exit_code != ExitCode.FAILURE:
            return self._stopped_block()
        label = describe(self.exit_code, rc.script_code)
        label = "" if label == f"exit code {self.exit_code}" else f" ({label})"  # a script's code: no label
        lines = [RULE, f"gpuherd: run {self.run_id} FAILED with exit code {self.exit_code}{label}",
                 f"root cause: {rc.message}"]
        lines += [f"    {line}" for line in rc.evidence]
        lines += [d.line(name_attempt=self.max_restarts > 0) for d in self.suspect_devices]
        lines += self._recovery_lines()
        lines += self._attempt_lines()
        if rc.traceback:  # the rank's own account (torch's @record): the stderr tail would repeat it
            lines.append(f"traceback of {rc.device} (rank {rc.rank}), from its error file:")
            lines += [f"    {line}" for line in rc.traceback]
        elif rc.stderr_tail:
            lines.append(f"last lines of {rc.device} (rank {rc.rank}) stderr:")
            lines += [f"    {line}" for line in rc.stderr_tail]
        victims = [w for w in self.workers if w.role == "victim"]
        if victims:
            lines.append("stopped by the supervisor: " + ", ".join(
                f"{w.device} (rank {w.rank}, {w.ended})" for w in victims))
        lines += self._straggler_lines()
        lines += self._goodput_lines()
        lines += [f"note: {n}" for n in self.notes]
        if self.teardown_s is not None:
            lines.append(f"teardown: every worker gone {self.teardown_s * 1000:.0f} ms after the first failure")
        lines += self._node_lines()
        lines += [f"details: {self.run_dir}/summary.json, worker logs in {self.run_dir}", RULE]
        return "\n".join(lines)

    def _recovered(self, action: str | None = None) -> int:
        """Recoveries that recovered: regrows (`action` "regrow") apart from the rest, which each had a loss."""
        return sum(1 for r in self.recoveries if r.get("outcome") == "recovered" and
                   (r.get("action") == "regrow") == (action == "regrow"))

    def _recovery_lines(self) -> list[str]:
        lines = []
        for r in self.recoveries:
            where = f"node {r['node']}'s " if r.get("node") is not None else ""  # multi-node: that node's spare
            if r.get("outcome") == "recovered" and r.get("action") == "regrow":
                lines.append(f"live recovery {r['number']}: regrow: warm spare pid {r['replaced_by_pid']} took back rank "
                             f"{r['rank']} ({r['device']}) after {r.get('shrunk_s') or 0:.1f} s shrunk: "
                             f"{r['replicas']} process(es) trained on, its data slot no longer carried, "
                             f"{r['seconds']:.2f} s to its first completed step, no checkpoint read")
            elif r.get("outcome") == "recovered" and r.get("action") == "shrink" and r.get("kind") == "node":
                lines.append(f"live recovery {r['number']}: node {r['node']} died whole -> no spare node left: "
                             f"{r['replicas']} process(es) on the other nodes went on with its ranks' data slots (same "
                             f"global batch) for {r.get('shrunk_s') or 0:.1f} s, {r['seconds']:.2f} s to the next "
                             f"completed step, {r['steps_redone']} completed step(s) redone, no checkpoint read")
            elif r.get("outcome") == "recovered" and r.get("action") == "shrink":
                lines.append(f"live recovery {r['number']}: rank {r['rank']} ({r['device']}) {r['failed']} -> no spare "
                             f"left: {r['replicas']} process(es) went on with its data slot (same global batch) for "
                             f"{r.get('shrunk_s') or 0:.1f} s, "
                             f"{r['seconds']:.2f} s to the next completed step, {r['steps_redone']} completed step(s) "
                             "redone, no checkpoint read")
            elif r.get("outcome") == "recovered" and r.get("action") == "spare-node":
                lines.append(f"live recovery {r['number']}: node {r['node']} died whole -> spare node {r['spare_node']} "
                             f"took its ranks, {r['seconds']:.2f} s to the next completed step, {r['steps_redone']} "
                             "completed step(s) redone, no checkpoint read")
            elif r.get("outcome") == "recovered":
                lines.append(f"live recovery {r['number']}: {where}rank {r['rank']} ({r['device']}) {r['failed']} -> spare pid "
                             f"{r['replaced_by_pid']}, {r['seconds']:.2f} s to the next completed step, "
                             f"{r['steps_redone']} completed step(s) redone, no checkpoint read")
            else:
                lines.append(f"live recovery {r['number']} of {where}rank {r['rank']} ({r['device']}) failed: {r['failed']}")
            if r.get("straggler") and r.get("outcome") == "recovered":
                lines.append(f"    {moved_out_line(r)}")
        return lines

    def _stopped_block(self) -> str:
        """A stop someone asked for (Ctrl-C, scancel, a time limit, a preemption) whose final
        save completed, or had nothing to save: not a failure, so no failure block."""
        lines = [f"gpuherd: run {self.run_id} stopped (exit {self.exit_code})", f"root cause: {self.root_cause.message}"]
        lines += self._attempt_lines() + self._straggler_lines() + self._goodput_lines()
        lines += [f"note: {n}" for n in self.notes]
        lines += self._node_lines()
        lines.append(f"details: {self.run_dir}/summary.json, worker logs in {self.run_dir}")
        return "\n".join(lines)

    def _node_lines(self) -> list[str]:
        """Node 0 of a multi-node job prints the job's one summary: how every node ended."""
        if len(self.node_outcomes) < 2:
            return []
        lines = []
        for n in self.node_outcomes:
            if "exit_code" not in n:
                lines.append(f"node {n.get('node')}: {n.get('outcome')}")
                continue
            save = f", final checkpoint {n['final_save']}" if n.get("final_save") else ""
            lines.append(f"node {n['node']} ({n.get('host')}): exit {n['exit_code']} ({n.get('outcome')}){save}; "
                         f"{n.get('run_dir')}")
        return lines

    def _goodput_lines(self) -> list[str]:
        if not self.goodput or not self.goodput.get("wall_s"):
            return []
        return [console_line(Goodput(**self.goodput))]

    def _straggler_lines(self) -> list[str]:
        return [(f"straggler: node {s['node']} computed {s['slowdown']:.2f}x slower than the other nodes"
                 + (f" for {s.get('held_s') or 0:.0f} s: moved out, a spare node took its place"
                    if s.get("moved_out") else "")
                 if s.get("node") is not None else
                 f"straggler: rank {s['rank']} computed {s['slowdown']:.2f}x slower than the others")
                + (f" ({s['reason']})" if s.get("reason") else "") for s in self.stragglers]

    def _attempt_lines(self) -> list[str]:
        """One line per failed attempt that was restarted, and why the last failure was not."""
        if not self.attempts or (self.max_restarts == 0 and len(self.attempts) == 1):
            return []
        lines = []
        for a in self.attempts[:-1]:
            resumed = f"; attempt {a.attempt + 1} resumed from {self.attempts[a.attempt + 1].resumed_from}" \
                if self.attempts[a.attempt + 1].resumed_from else f"; attempt {a.attempt + 1} started afresh"
            if a.script_saves is not None:  # what the script resumed from is its own business: what was seen
                resumed = f"; attempt {a.attempt + 1} started the script again; {a.script_saves['said']}"
            ended = "was restarted for a membership change" if a.outcome == "membership" \
                else f"failed with exit code {a.exit_code}"  # elastic: a node asked to join
            lines.append(f"attempt {a.attempt} {ended}: {a.root_cause.message if a.root_cause else a.outcome}{resumed}")
        last = self.attempts[-1]
        if last.not_restarted:
            lines.append(f"not restarted: {last.not_restarted}")
        return lines


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="milliseconds")


def as_dict(summary: Summary) -> dict[str, Any]:
    return orjson.loads(summary.to_json())
