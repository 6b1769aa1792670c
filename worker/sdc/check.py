"""The trainer's side of silent-data-corruption checks: after each optimizer step (at the
interval), fingerprint, compare across the data-parallel group, name, heal, count strikes.

The healthy path costs one pass over the parameters (fingerprint.py), one all_gather of a few
hundred bytes and one host sync; the optimizer state (AdamW: twice the parameters) is added at
its own, longer interval. A check is also due right before every checkpoint, so no unchecked
state is ever saved. On a mismatch (phase `sdc` while it is handled):

- a strict majority names the odd ranks; they take a healthy rank's state by broadcast and the
  run goes on; the replicas are compared again to confirm;
- two replicas (or no majority): every rank rolls back to the state kept where the replicas
  last agreed (heal.Kept) and recomputes the steps since; at the same check the recomputed
  sums agree, and the rank whose first sums differ from them is named; if the recompute
  disagrees again the fault is persistent: every disagreeing rank is suspect and the run stops
  (exit 8) rather than training on an unknown replica.

FSDP holds no replicas: there each rank recomputes its optimizer step at the optimizer-state
interval instead (recompute.py) and a rank whose first result differs is named and keeps the
recomputed one.

Each corrupted rank says so in one console banner (device, host, rank, step) and a `suspect`
status record (the supervisor's suspect list: summary.json, `gpuherd report`, a restart with
--exclude-suspect-gpus, the list that outlives the run), and the lowest healthy rank sends one
`sdc` record with the evidence. A second strike on the same rank's device ends the run's use of
it: that rank alone exits 8, the others go on and meet its absence in their next collective
(live recovery moves the rank to a warm spare or shrinks the group; else the attempt restarts).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from loguru import logger

from gpuherd.exit_codes import ExitCode
from worker.distributed import WorkerError, gather_objects
from worker.sdc import blame, heal, injector
from worker.sdc.fingerprint import Fingerprint, optimizer_state, parameters
from worker.sdc.parts import Group, Loop, SdcSettings
from worker.sdc.recompute import StepRecompute

if TYPE_CHECKING:
    from gpuherd.contract import WorkerIdentity
    from gpuherd.liveness import Liveness
    from gpuherd.status_channel import StatusWriter
    from worker.engines import Engine

# Strategies whose ranks hold replicas: what of their state is replicated. Not ZeRO-1: each rank
# updates its own shard of the parameters and broadcasts it, so a fault in that update reaches
# every replica alike, and its optimizer state exists once.
REPLICATED = {"ddp": ("param", "optim")}
STRIKES_ALLOWED = 1


@dataclass
class Pending:
    """A two-replica mismatch being recomputed: the first sums of every rank at `step`."""

    step: int
    rows: list[tuple[int, ...]]
    names: list[str]
    widths: list[int]


def gather_rows(sums: torch.Tensor, world: int) -> list[tuple[int, ...]]:
    """Every rank's sums, by rank: one all_gather of a few hundred bytes."""
    out = [torch.empty_like(sums) for _ in range(world)]
    dist.all_gather(out, sums)
    return [tuple(row.cpu().tolist()) for row in out]  # the one host sync of a check


class SdcCheck:
    """Built from its parts (worker/sdc/parts.py), not the trainer: the engine whose state is
    compared, this process's identity and device, the status writer and liveness it reports
    through, the group (live recovery's), and the loop's step counter and rollback hooks."""

    def __init__(self, settings: SdcSettings, engine: Engine, identity: WorkerIdentity, device: torch.device,
                 status: StatusWriter, live: Liveness, group: Group, loop: Loop) -> None:
        self.settings, self.engine, self.identity, self.device = settings, engine, identity, device
        self.status, self.live, self.group, self.loop = status, live, group, loop
        self.every, self.optim_every = settings.every, settings.optim_every
        self.replicated = REPLICATED.get(settings.strategy, ()) if self.world > 1 and self.every else ()
        # nothing replicated (FSDP): the step is recomputed at the optimizer-state interval instead
        recompute = settings.strategy == "fsdp" and self.world > 1 and self.every and self.optim_every
        self.recompute = StepRecompute(engine.inner, engine.optimizer,
                                       lambda: self._due(loop.step() + 1, self.optim_every)) if recompute else None
        for flip in injector.from_env(self.world):
            if self.rank == 0:
                logger.warning(f"{identity.bracket} {flip.describe()}: rank {flip.rank} flips one bit of its "
                               f"{flip.target} at step {flip.step} (a test fault)")
            injector.arm(flip, identity.rank, engine.inner, engine.optimizer, loop.step)
        self.strikes: Counter[int] = Counter()
        self.struck_at: dict[int, list[int]] = {}
        self.pending: Pending | None = None
        # no majority can decide between two replicas: keep a verified state to recompute from. A
        # kept state belongs to one process group (live recovery builds new ones, and a spare's
        # peers kept theirs earlier): a rollback needs every rank at the same one.
        self.generation = self._generation()
        first = self.world == 2 and self.replicated and self.generation == 0
        self.kept = self._keep(loop.step()) if first else None

    # The group the replicas are compared in: after a shrink (worker/data_slots.py) it has fewer
    # members than the job's ranks, each at its own place in it. Rows, culprits and broadcast
    # sources are places in the group; strikes, records and messages name the job's ranks.
    @property
    def members(self) -> list[int]:
        return self.group.ranks

    @property
    def rank(self) -> int:
        return self.members.index(self.identity.rank)

    @property
    def world(self) -> int:
        return len(self.members)

    def _named(self, places: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.members[p] for p in places)

    # ------------------------------------------------------------------ the hook
    def after_step(self, step: int) -> bool:
        """After optimizer step `step` (0-based). True: the trainer was rolled back (heal.Kept)
        and its loop goes on from there."""
        done = step + 1
        if self.recompute is not None and self._due(done, self.optim_every):
            self._recompute(step)
        if not self.replicated or not self._due(done, self.every):
            return False
        with_optim = "optim" in self.replicated and self._due(done, self.optim_every)
        fp, widths = self._fingerprint(with_optim)
        rows = self._gather(fp)
        verdict = blame.judge(rows)
        if self.generation != self._generation():  # a rebuilt group: keep nothing from the old one
            self.generation, self.kept, self.pending = self._generation(), None, None
        if verdict.agree:
            if self.pending is not None and self.pending.step == step:
                self._settled(rows[0])
            if self.world == 2 and (with_optim or "optim" not in self.replicated or self.kept is None):
                self.kept = self._keep(done)
            return False
        return self._mismatch(step, fp, widths, rows, verdict, with_optim)

    # ------------------------------------------------------------------ pieces
    def _due(self, done: int, every: int) -> bool:
        """A check after `done` completed steps: every `every`-th, and before each checkpoint."""
        return bool(every) and (done % every == 0 or self.settings.saves.saved_after(done))

    def _recompute(self, step: int) -> None:
        started = time.perf_counter()
        found = self.recompute.verify()
        (flags,) = zip(*self._gather(Fingerprint([], torch.tensor([int(bool(found))], device=self._wire()))),
                       strict=True)
        culprits = tuple(r for r, bad in enumerate(flags) if bad)
        if culprits:
            self.status.send("phase", name="sdc")
            healthy = min(set(range(self.world)) - set(culprits), default=None)
            evidence = [line for lines in gather_objects(found) for line in lines]  # for the sdc record
            self._strike(step, culprits, healthy, "recompute", "the recomputed step, kept in place",
                         found or evidence, time.perf_counter() - started)
            self.status.send("phase", name="train")

    def _fingerprint(self, with_optim: bool) -> tuple[Fingerprint, list[int]]:
        engine = self.engine
        named = parameters(engine.inner)
        if with_optim:
            named += optimizer_state(engine.inner, engine.optimizer)
        return Fingerprint.of(named, self._wire()), [8 * t.element_size() for _, t in named]

    def _generation(self) -> int:
        return self.group.generation

    def _keep(self, completed: int) -> heal.Kept:
        return heal.Kept.take(self.engine, self.loop, self.device, completed)

    def _wire(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _gather(self, fp: Fingerprint) -> list[tuple[int, ...]]:
        with self.live.collective("all_gather (sdc fingerprint)"):
            return gather_rows(fp.sums, self.world)

    def _mismatch(self, step: int, fp: Fingerprint, widths: list[int], rows: list[tuple[int, ...]],
                  verdict: blame.Verdict, with_optim: bool) -> bool:
        started = time.perf_counter()
        self.status.send("phase", name="sdc")
        if verdict.culprits:
            good = rows[verdict.healthy[0]]
            found = [d.describe() for r in verdict.culprits
                     for d in blame.differences(fp.names, widths, rows[r], good)]
            self._heal_by_broadcast(step, verdict, found, with_optim, started)
            self.status.send("phase", name="train")
            return False
        if self.kept is None or self.pending is not None:
            suspects = tuple(range(self.world)) if self.pending is None else blame.against(self.pending.rows, rows[0])
            why = ("the replicas disagree and nothing decides which is right" if self.pending is None
                   else "the recomputed step disagrees again: a persistent fault")
            self._stop(step, suspects or tuple(range(self.world)), why)
        self.pending = Pending(step, rows, fp.names, widths)
        if self.rank == 0:
            logger.warning(f"{self.identity.bracket} silent data corruption check: the 2 replicas disagree after step "
                           f"{step}; rolling back to step {self.kept.step} (the last state they agreed on) to "
                           f"recompute {step + 1 - self.kept.step} step(s) and see whose result changes")
        self.kept.restore(self.engine, self.loop, self.device)
        self.loop.exclude_pause(time.perf_counter() - started)
        return True

    def _heal_by_broadcast(self, step: int, verdict: blame.Verdict, found: list[str], with_optim: bool,
                           started: float) -> None:
        source = verdict.healthy[0]
        corrupted = self.rank in verdict.culprits
        mine = heal.engine_state(self.engine) if corrupted else None
        mine = heal.host_copy(mine) if mine is not None else None
        received = heal.take_from(self.engine, source, self.rank, corrupted, self.device)
        located = []
        if received is not None and mine is not None:
            located = heal.locate(mine["model"], received["model"]) or heal.locate(
                heal.named_optimizer_state(self.engine, mine["optimizer"]),
                heal.named_optimizer_state(self.engine, received["optimizer"]))
        after = blame.judge(self._gather(self._fingerprint(with_optim)[0]))
        if not after.agree:
            self._stop(step, verdict.culprits, "the replicas still disagree after the healthy state was broadcast")
        self._strike(step, verdict.culprits, source, "majority", f"broadcast from rank {source}",
                     located or found, time.perf_counter() - started)

    def _settled(self, agreed: tuple[int, ...]) -> None:
        """The recompute of a two-replica mismatch agreed: name who changed."""
        p, self.pending = self.pending, None
        culprits = blame.against(p.rows, agreed)
        found = [d.describe() for r in culprits for d in blame.differences(p.names, p.widths, p.rows[r], agreed)]
        self._strike(p.step, culprits, min(set(range(self.world)) - set(culprits), default=None), "recompute",
                     f"rollback to step {self.kept.step} and recompute", found, 0.0)
        self.status.send("phase", name="train")

    def _strike(self, step: int, culprits: tuple[int, ...], healthy: int | None, blamed_by: str, healed: str,
                found: list[str], seconds: float) -> None:
        named = self._named(culprits)
        for r in named:
            self.strikes[r] += 1
            self.struck_at.setdefault(r, []).append(step)
        me = self.identity.rank
        device = host = "?"
        if self.rank in culprits:
            from worker.nan import device_label, hostname

            differed = ("its replica differed from the others" if self.replicated else
                        "its optimizer step's result differed from a recompute of the step")

            device, host = device_label(self.device, self.identity.bracket), hostname()
            logger.error(f"{self.identity.bracket} SILENT DATA CORRUPTION on {device}, host {host}, rank {me}, "
                         f"step {step}: {differed} ({'; '.join(found[:2]) or 'see the sdc record'})"
                         f"; named by {blamed_by}, healed by {healed}; strike {self.strikes[me]} of "
                         f"{STRIKES_ALLOWED + 1}")
            self.status.send("suspect", step=step, device=device, host=host, transient_faults=self.strikes[me],
                          limit=STRIKES_ALLOWED, cause="silent data corruption")
        if healthy is not None and self.rank == healthy:
            self.status.send("sdc", step=step, culprits=list(named), blamed_by=blamed_by, healed=healed,
                          evidence=found[:4], seconds=round(seconds, 4))
        # Only the struck rank leaves: its peers, healed, go on into the next step, where they find it
        # gone and the supervisor's live recovery decides (a warm spare takes the rank, or the group
        # shrinks), or it tears the attempt down and restarts without the device.
        if self.rank in culprits and self.strikes[me] > STRIKES_ALLOWED:
            raise WorkerError(f"silent data corruption: rank {me}'s device disagreed with its replicas "
                              f"{self.strikes[me]} times (steps {', '.join(map(str, self.struck_at[me]))}): not "
                              f"used again in this run ({device}, host {host}, step {step})", ExitCode.DEVICE_SUSPECT)

    def _stop(self, step: int, suspects: tuple[int, ...], why: str) -> None:
        raise WorkerError(f"silent data corruption after step {step}: {why}; suspect ranks "
                          f"{', '.join(map(str, self._named(suspects)))}", ExitCode.DEVICE_SUSPECT)
