"""NanGuard: the worker's one entry point for suspicious steps (NaN/Inf and spikes).

    guard = NanGuard(cfg, model, identity, status, save_checkpoint, scaler=engine.scaler)
    guard.attach()                      # after wrapping (DDP / compile / FSDP2)
    guard.begin_step(source)            # before the step draws its batches
    apply = guard.check(step=..., loss=..., grad_norm=..., batches=..., lr=..., replay=...)
    loss, grad_norm = guard.retried or (loss, grad_norm)
    guard.detach()

`check` runs on every rank after backward + clipping and before
`optimizer.step()`. Healthy step: one 4-element all-reduce + one host sync (see
consensus.py), returns True. Suspicious step (agreed by all ranks): per policy
(`debug.nan_policy` for NaN/Inf, `debug.spike_policy` for spikes) report and stop
(raise NanStop), skip (False), or replay it (rerun_policy.py): a transient fault is
retried (True, `retried` holds the replay's loss and norm), a reproducible one
names the batch and stops.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from gpuherd.config import Config
from gpuherd.contract import WorkerIdentity
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.liveness import Liveness
from gpuherd.status_channel import StatusWriter
from gpuherd import rng
from worker.nan import dump
from worker.nan.consensus import StepVerdict, agree, device_label, distributed, gather_dicts, hostname, local_flags
from worker.nan.evidence import Evidence, nonfinite_evidence, number_or_text, spike_evidence
from worker.nan.names import is_dtensor, local_tensor
from worker.nan.probes import ForwardProbe, GradProbe, MicroBatchCounter
from worker.nan.rerun_policy import (
    Classification,
    FaultLedger,
    KeptStep,
    RerunRecord,
    classify,
    clear_gradients,
    deterministic_kernels,
    restore_kernels,
)
from worker.nan.samples import SampleName, name_batch
from worker.nan.spikes import SpikeDetector

STATUS_RANKS = 64  # rank ids listed in a `nan` / `spike` status record
BATCH_LINES = 8  # sample names printed with a reproducible fault (all of them go to the dump)
KIND_WORDS = {"nonfinite": "non-finite loss or gradient", "loss_spike": "loss spike",
              "grad_norm_spike": "gradient-norm spike"}


class NanStop(GpuherdError, RuntimeError):
    """Raised on every rank together; the worker exits with `exit_code` (6, 7 or 8)."""

    exit_code = ExitCode.NAN

    def __init__(self, message: str, step: int, ranks: list[int], report: Path | None, checkpoint: Path | None,
                 exit_code: int | None = None) -> None:
        super().__init__(message, exit_code)
        self.step = step
        self.ranks = ranks
        self.report = report
        self.checkpoint = checkpoint


@dataclass
class _Step:
    """The step under judgement: its scalars on the device and what every rank agreed."""

    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    local: torch.Tensor  # this rank's flags (consensus.local_flags)
    verdict: StepVerdict
    batches: list[Any]
    lr: float
    replay: Callable[[], tuple[Any, Any]] | None


class NanGuard:
    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        identity: WorkerIdentity,
        status: StatusWriter,
        save_checkpoint: Callable[[Path], None] | None,
        scaler: Any = None,
        live: Liveness | None = None,
    ) -> None:
        """`live`: the rank's liveness, told while the step's verdict is being agreed on (an
        all-reduce: a rank stuck there waits for a peer, which hang blame must know)."""
        self.cfg = cfg
        self.live = live
        self.model = model
        self.identity = identity
        self.status = status
        self.save_checkpoint = save_checkpoint
        self.scaler = scaler  # fp16's GradScaler: a replay must be able to unscale again
        self.checkpoint_dir = Path(cfg.system.checkpoint_dir)
        self.consecutive_skips = 0
        self.skipped_steps: list[int] = []
        # fp16 autocast trains with a dynamic GradScaler: an Inf/NaN gradient is
        # then its normal overflow signal (scaler.step skips, the scale drops),
        # not divergence, so only a non-finite loss counts. bf16/fp32 have no
        # scaler: there every non-finite gradient norm is a real problem.
        self.scaler_owns_overflow = cfg.training.use_amp and cfg.training.amp_dtype == "fp16"
        self.spikes = SpikeDetector.from_config(cfg.debug)
        self.replaying = "rerun" in (cfg.debug.nan_policy, cfg.debug.spike_policy)
        self.ledger = FaultLedger()
        self.kept: KeptStep | None = None
        self.retried: tuple[torch.Tensor, torch.Tensor] | None = None  # the replay's (loss, grad_norm)
        self._kernels_before: tuple[bool, bool] | None = None
        self._counter = MicroBatchCounter()
        self._forward: ForwardProbe | None = None
        self._grads: GradProbe | None = None

    def _agree(self, local: torch.Tensor) -> StepVerdict:
        if self.live is None:
            return agree(local)
        with self.live.collective("all_reduce (step check)"):
            return agree(local)

    # ------------------------------------------------------------------ hooks

    def attach(self) -> None:
        """Install the debug probes (forward hooks + local-gradient hooks) when
        `debug.nan_hooks` is on; production runs keep the model untouched. A rerun
        policy also switches to deterministic kernels (`debug.rerun_deterministic`)."""
        if not self.cfg.debug.nan_detection:
            return
        if self.replaying and self.cfg.debug.rerun_deterministic and self._kernels_before is None:
            self._kernels_before = deterministic_kernels()
        if not self.cfg.debug.nan_hooks or self._forward:
            return
        self._forward = ForwardProbe(self.model, self._counter)
        self._grads = GradProbe(self.model, self._counter)
        self._forward.attach()
        self._grads.attach()
        logger.debug(f"{self.identity.bracket} NaN probes attached: forward hooks on every module,"
                     " local-gradient hooks on every parameter (leaf modules for sharded ones)")

    def detach(self) -> None:
        for probe in (self._forward, self._grads):
            if probe is not None:
                probe.detach()
        self._forward = self._grads = None
        if self._kernels_before is not None:
            restore_kernels(self._kernels_before)
            self._kernels_before = None

    # ------------------------------------------------------------------ per step

    def begin_step(self, source: Any = None) -> None:
        """Before the step draws its batches: keep where they come from (to name them on
        the bad path) and, under a rerun policy, the RNG states (to replay the step)."""
        if not self.cfg.debug.nan_detection:
            return
        position = source.state_dict() if source is not None else None
        self.kept = KeptStep(source, position, rng.capture(self._device()) if self.replaying else None)

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
              batches: list[Any], lr: float, replay: Callable[[], tuple[Any, Any]] | None = None) -> bool:
        """True: apply this step. False: skip it (policy skip). Raises NanStop.
        `replay()` runs the step's forward/backward and clipping again on the kept
        batches and returns (loss, grad_norm); policy rerun needs it."""
        self.retried = None
        if not self.cfg.debug.nan_detection:
            return True
        loss_t, norm_t = self._scalars(loss, grad_norm)
        local = self._flags(loss_t, norm_t)
        verdict = self._agree(local)
        if not verdict.suspicious:
            self._healthy(loss_t, norm_t, verdict)
            return True
        try:
            return self._suspicious(_Step(step, loss_t, norm_t, local, verdict, batches, lr, replay))
        finally:
            self._reset_probes()

    def _scalars(self, loss: Any, grad_norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        device = next((t.device for t in (loss, grad_norm) if isinstance(t, torch.Tensor)), None)
        if device is None:
            device = self._device()
        if grad_norm is None:  # clipping disabled: the same norm clipping would compute
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(grad_norm, torch.Tensor) and is_dtensor(grad_norm):
            grad_norm = grad_norm.full_tensor()  # FSDP2: a Partial/Replicate DTensor
        loss_t = torch.as_tensor(loss, dtype=torch.float32).detach().to(device).reshape(())
        norm_t = torch.as_tensor(grad_norm, dtype=torch.float32).detach().to(device).reshape(())
        return loss_t, norm_t

    def _flags(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Every test of the step as device ops: nothing here reads back to the host."""
        norm_bad = ~torch.isfinite(grad_norm)
        nonfinite = ~torch.isfinite(loss)
        if not self.scaler_owns_overflow:
            nonfinite = nonfinite | norm_bad
        if self.spikes is None:
            no = torch.zeros((), dtype=torch.bool, device=loss.device)
            return local_flags(nonfinite, no, no, norm_bad)
        loss_spike, norm_spike = self.spikes.flags(loss, grad_norm)
        # An Inf norm is not a spike: it is non-finite, or under fp16 the scaler's overflow signal.
        return local_flags(nonfinite, loss_spike, norm_spike.to(loss.device) & ~norm_bad, norm_bad)

    def _healthy(self, loss: torch.Tensor, grad_norm: torch.Tensor, verdict: StepVerdict) -> None:
        self.consecutive_skips = 0
        if self.spikes is not None:
            self.spikes.observe(loss, grad_norm if verdict.grad_norm_finite else None)
        self._reset_probes()

    def _reset_probes(self) -> None:
        self._counter.reset()
        for probe in (self._forward, self._grads):
            if probe is not None:
                probe.reset()

    # ------------------------------------------------------------------ suspicious steps

    def _suspicious(self, s: _Step) -> bool:
        key = "nan_policy" if s.verdict.nonfinite else "spike_policy"
        policy = getattr(self.cfg.debug, key)
        if policy != "rerun":
            return self._conclude(s, policy, why=f"debug.{key}={policy}")
        if s.replay is not None and self.kept is not None and self.kept.rng is not None:
            return self._rerun(s)
        missing = ("no replay handed over: DeepSpeed checks after its own optimizer step" if s.replay is None
                   else "no RNG state kept: begin_step was not called")
        why = f"debug.{key}=rerun, but this step cannot be replayed ({missing})"
        logger.warning(f"{self.identity.bracket} {why}: stopping instead")
        return self._conclude(s, "stop", why=why)

    def _rerun(self, s: _Step) -> bool:
        """Replay the step on every rank (collectives inside) and classify it."""
        first_loss, first_norm = float(s.loss), float(s.grad_norm)
        own = s.local.cpu().tolist()
        evidence = (not math.isfinite(first_loss) or own[1] > 0
                    or bool(self._forward and self._forward.first_bad()) or bool(self._grads and self._grads.first_bad()))
        rng.restore(self.kept.rng, self._device())
        self._reset_probes()
        clear_gradients(self.model, self.scaler)
        loss, norm = self._scalars(*s.replay())
        local = self._flags(loss, norm)
        again = self._agree(local)
        bracket = self.identity.bracket
        mine = RerunRecord(self.identity.rank, bracket, hostname(), device_label(self._device(), bracket),
                           first_loss, first_norm, float(loss), float(norm), evidence)
        outcome = classify([RerunRecord(**raw) for raw in gather_dicts(asdict(mine))], again.suspicious)
        if outcome.transient:  # the replay is healthy: its verdict says what enters the spike history
            return self._transient(_Step(s.step, loss, norm, local, again, s.batches, s.lr, None), outcome,
                                   s.verdict.kind)
        replayed = _Step(s.step, loss, norm, local, again if again.suspicious else s.verdict, s.batches, s.lr, None)
        return self._conclude(replayed, "rerun", outcome=outcome,
                              why="reproduced on replay: the batch or the model, not the device")

    def _transient(self, s: _Step, outcome: Classification, kind: str) -> bool:
        """The replay came out healthy: apply it, count the device, stop when it has had too many."""
        self.ledger.add(outcome.culprits)
        limit = self.cfg.debug.max_transient_faults
        over = self.ledger.over(limit)
        me = self.identity.rank
        mine = next(r for r in outcome.records if r.rank == me)
        blamed = "; ".join(f"{r.describe()} ({self.ledger.counts[r.rank]} transient fault(s), limit {limit})"
                           for r in outcome.culprit_records())
        blamed = blamed or (f"not identified among ranks {[r.rank for r in outcome.records]} (the gradient"
                            " reduction mixes them; debug.nan_hooks=true names the rank whose local gradients went bad)")
        message = (f"{self.identity.bracket} Transient fault at step {s.step}: the {KIND_WORDS[kind]} did not"
                   f" reproduce on replay (loss {mine.loss:.4f} -> {mine.replay_loss:.4f}, grad norm"
                   f" {mine.grad_norm:.4f} -> {mine.replay_grad_norm:.4f}); suspect device: {blamed}")
        speaks = me in outcome.culprits or (not outcome.culprits and me == outcome.records[0].rank)
        (logger.warning if speaks else logger.debug)(message + ("" if over else "; step retried"))
        self.status.send("nan" if kind == "nonfinite" else "spike", step=s.step, kind=kind,
                         action="stop" if over else "retried", classification="transient",
                         culprits=outcome.culprits[:STATUS_RANKS], loss=number_or_text(mine.loss),
                         grad_norm=number_or_text(mine.grad_norm), replay_loss=number_or_text(mine.replay_loss),
                         replay_grad_norm=number_or_text(mine.replay_grad_norm))
        if me in outcome.culprits:
            self.status.send("suspect", step=s.step, device=device_label(self._device(), self.identity.bracket),
                             host=hostname(), transient_faults=self.ledger.counts[me], limit=limit,
                             stopping=bool(over))
        if over:
            who = ", ".join("an unidentified rank" if r is None else f"rank {r}" for r in over)
            logger.error(f"{self.identity.bracket} Stopping at step {s.step}: {who} had more than"
                         f" debug.max_transient_faults={limit} transient faults; exit code {int(ExitCode.DEVICE_SUSPECT)}")
            raise NanStop(f"suspect device: {who} had more than {limit} transient faults (last at step {s.step})",
                          s.step, [r for r in over if r is not None], None, None, ExitCode.DEVICE_SUSPECT)
        self.consecutive_skips = 0
        self.retried = (s.loss, s.grad_norm)
        if self.spikes is not None:
            self.spikes.observe(s.loss, s.grad_norm if s.verdict.grad_norm_finite else None)
        return True

    def _conclude(self, s: _Step, policy: str, why: str, outcome: Classification | None = None) -> bool:
        """Report, dump, and stop or skip (policies stop/skip, and a reproducible rerun)."""
        loss, norm = float(s.loss), float(s.grad_norm)
        if s.verdict.nonfinite:
            ev = nonfinite_evidence(self.model, self.identity, (self._forward, self._grads), s.step, loss, norm,
                                    s.lr, self.cfg.debug.max_dump_mb)
        else:
            ev = spike_evidence(self.model, self.identity, self.spikes, s.verdict, s.local.cpu().tolist(),
                                s.step, loss, norm, s.lr)
        stop, code, why = self._decide(s, policy, why, outcome)
        kept = self.kept or KeptStep(None, None, None)
        names = name_batch(kept.source, kept.position, s.batches, self.identity.rank)
        bracket, me = self.identity.bracket, self.identity.rank
        if me in ev.reporters:
            for line in ev.banner + (_rerun_lines(outcome, names) if outcome else []):
                logger.error(line)
        else:
            logger.error(f"{bracket} {_what(ev.kind)} at step {s.step} produced on rank(s) {ev.origin};"
                         f" full report from rank(s) {ev.reporters}")
        pkl = self._write_dump(s, ev, names, policy, stop, outcome) if me in ev.dumpers else None
        ckpt = self._save_checkpoint(s.step) if stop else None
        if me in ev.reporters and ckpt is not None:
            logger.error(f"Checkpoint saved: {_show(ckpt)}")
        if pkl is not None:
            logger.error(f"Debug tensors saved: {_show(pkl)}")
        # The record must stay under PIPE_BUF or the channel drops its fields: cap the list.
        self.status.send(ev.record_type, step=s.step, ranks=ev.origin[:STATUS_RANKS], n_ranks=len(ev.origin),
                         report=str(pkl) if pkl else None, checkpoint=str(ckpt) if ckpt else None,
                         action="stop" if stop else "skip", kind=ev.kind,
                         classification=outcome.label if outcome else None, **ev.fields)
        if stop:
            logger.error(f"{bracket} Stopping at step {s.step} ({why}); exit code {int(code)}")
            raise NanStop(f"{KIND_WORDS[ev.kind]} at step {s.step} on rank(s) {ev.origin}"
                          + (f": {why}" if outcome else ""), s.step, ev.origin, pkl, ckpt, code)
        logger.warning(f"{bracket} {why}: step {s.step} not applied"
                       f" ({self.consecutive_skips}/{self.cfg.debug.max_nan_skips} in a row,"
                       f" {len(self.skipped_steps)} skipped in all)")
        return False

    def _decide(self, s: _Step, policy: str, why: str, outcome: Classification | None) -> tuple[bool, int, str]:
        """(stop?, exit code, why) for the step; counts skips."""
        if outcome is not None:
            return True, ExitCode.DATA_MODEL, why
        if policy != "skip":
            return True, ExitCode.NAN, why
        self.consecutive_skips += 1
        self.skipped_steps.append(s.step)
        if self.consecutive_skips <= self.cfg.debug.max_nan_skips:
            return False, ExitCode.OK, why
        what = "non-finite" if s.verdict.nonfinite else "suspicious"
        return True, ExitCode.NAN, (f"{self.consecutive_skips} {what} steps in a row > debug.max_nan_skips="
                                    f"{self.cfg.debug.max_nan_skips}")

    # ------------------------------------------------------------------ files

    def _device(self) -> torch.device:
        return next((local_tensor(p).device for p in self.model.parameters()), torch.device("cpu"))

    def _world_size(self) -> int:
        return dist.get_world_size() if distributed() else self.identity.world_size

    def _write_dump(self, s: _Step, ev: Evidence, names: list[SampleName], policy: str, stop: bool,
                    outcome: Classification | None) -> Path | None:
        suffix = f"_rank{self.identity.rank}" if self._world_size() > 1 else ""
        path = self.checkpoint_dir / "debug" / f"nan_debug_step_{s.step}{suffix}.pkl"
        payload = {
            "format": dump.FORMAT, "kind": ev.kind,
            "step": s.step, "loss": float(s.loss), "grad_norm": float(s.grad_norm), "lr": s.lr,
            "rank": self.identity.rank, "world_size": self._world_size(), "tag": self.identity.tag,
            "device": ev.device, "host": hostname(),
            "batch_token_ids": dump.token_ids(s.batches), "batch_target_ids": dump.target_ids(s.batches),
            "batch": [asdict(n) for n in names],
            "policy": policy, "action": "stop" if stop else "skip",
            "classification": outcome.label if outcome else None,
            "rerun": [asdict(r) for r in outcome.records] if outcome else None,
            **ev.dump_entries(),
        }
        try:
            dump.write_atomic(path, payload)
        except OSError as exc:
            logger.error(f"{self.identity.bracket} Debug tensors NOT saved to {path}: {exc}")
            return None
        return path

    def _save_checkpoint(self, step: int) -> Path | None:
        if self.save_checkpoint is None:
            return None
        path = self.checkpoint_dir / f"nan_grad_step_{step}.pt"
        try:
            self.save_checkpoint(path)  # every rank together: may be collective (FSDP)
        except Exception as exc:  # keep the NaN as the exit cause, say why there is no checkpoint
            logger.error(f"{self.identity.bracket} Checkpoint NOT saved to {path}: {type(exc).__name__}: {exc}")
            return None
        return path


def _what(kind: str) -> str:
    return {"nonfinite": "Non-finite loss/gradients", "loss_spike": "Loss spike",
            "grad_norm_spike": "Gradient-norm spike"}[kind]


def _rerun_lines(outcome: Classification, names: list[SampleName]) -> list[str]:
    how = "bit-identical on every rank" if outcome.identical else "suspicious again (not bit-identical)"
    lines = [f"Replayed on the same device: {how} -> the batch or the model is at fault, not the device",
             f"Batch ({len(names)} sample(s) on this rank):"]
    lines += [f"  • {n.describe()}" for n in names[:BATCH_LINES]]
    if len(names) > BATCH_LINES:
        lines.append(f"  ... and {len(names) - BATCH_LINES} more (the debug pickle's 'batch' lists all)")
    return lines


def _show(path: Path) -> str:
    """Relative to the working directory, as a user would type it (`.checkpoints/...`),
    when the file is below it, absolute otherwise."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except (OSError, ValueError):
        return str(path)
