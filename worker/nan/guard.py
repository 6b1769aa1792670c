"""NanGuard: the worker's one entry point for NaN/Inf forensics.

    guard = NanGuard(cfg, model, identity, status, save_checkpoint)
    guard.attach()                      # after wrapping (DDP / compile / FSDP2)
    apply = guard.check(step=..., loss=..., grad_norm=..., batches=..., lr=...)
    guard.detach()

`check` runs on every rank after backward + clipping and before
`optimizer.step()`. Good step: one 1-element all-reduce + one host sync (see
consensus.py), returns True. Bad step (agreed by all ranks): inspect, gather
attribution, report, dump, then skip (False) or stop (raise NanStop).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from loguru import logger

from gpuherd.config import Config
from gpuherd.contract import WorkerIdentity
from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from gpuherd.status_channel import StatusWriter
from worker.nan import dump
from worker.nan.banner import NanReport, render
from worker.nan.consensus import any_rank_bad, device_label, distributed, gather_records, hostname
from worker.nan.inspect_model import ModelInspection, inspect_model
from worker.nan.names import is_dtensor, local_tensor
from worker.nan.probes import ForwardProbe, GradProbe, MicroBatchCounter
from worker.nan.ranks import RankRecord

STATUS_RANKS = 64  # rank ids listed in a `nan` status record


class NanStop(GpuherdError, RuntimeError):
    """Raised on every rank together; the worker exits with `exit_code`."""

    exit_code = ExitCode.NAN

    def __init__(self, message: str, step: int, ranks: list[int], report: Path | None, checkpoint: Path | None):
        super().__init__(message)
        self.step = step
        self.ranks = ranks
        self.report = report
        self.checkpoint = checkpoint


class NanGuard:
    def __init__(
        self,
        cfg: Config,
        model: torch.nn.Module,
        identity: WorkerIdentity,
        status: StatusWriter,
        save_checkpoint: Callable[[Path], None] | None,
    ) -> None:
        self.cfg = cfg
        self.model = model
        self.identity = identity
        self.status = status
        self.save_checkpoint = save_checkpoint
        self.checkpoint_dir = Path(cfg.system.checkpoint_dir)
        self.consecutive_skips = 0
        self.skipped_steps: list[int] = []
        # fp16 autocast trains with a dynamic GradScaler: an Inf/NaN gradient is
        # then its normal overflow signal (scaler.step skips, the scale drops),
        # not divergence, so only a non-finite loss counts. bf16/fp32 have no
        # scaler: there every non-finite gradient norm is a real problem.
        self.scaler_owns_overflow = cfg.training.use_amp and cfg.training.amp_dtype == "fp16"
        self._counter = MicroBatchCounter()
        self._forward: ForwardProbe | None = None
        self._grads: GradProbe | None = None

    # ------------------------------------------------------------------ hooks

    def attach(self) -> None:
        """Install the debug probes (forward hooks + local-gradient hooks) when
        `debug.nan_hooks` is on; production runs keep the model untouched."""
        if not (self.cfg.debug.nan_detection and self.cfg.debug.nan_hooks) or self._forward:
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

    # ------------------------------------------------------------------ per step

    def check(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor | float | None,
              batches: list[torch.Tensor], lr: float) -> bool:
        """True: apply this step. False: skip it (policy skip). Raises NanStop."""
        if not self.cfg.debug.nan_detection:
            return True
        loss_t, norm_t = self._scalars(loss, grad_norm)
        finite = torch.isfinite(loss_t)
        if not self.scaler_owns_overflow:
            finite = finite & torch.isfinite(norm_t)
        if not any_rank_bad(~finite):
            self.consecutive_skips = 0
            self._reset_probes()
            return True
        try:
            return self._bad_step(step, float(loss_t), float(norm_t), batches, lr)
        finally:
            self._reset_probes()

    def _scalars(self, loss: Any, grad_norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        device = next((t.device for t in (loss, grad_norm) if isinstance(t, torch.Tensor)), None)
        if device is None:
            device = next((local_tensor(p).device for p in self.model.parameters()), torch.device("cpu"))
        if grad_norm is None:  # clipping disabled: the same norm clipping would compute
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if isinstance(grad_norm, torch.Tensor) and is_dtensor(grad_norm):
            grad_norm = grad_norm.full_tensor()  # FSDP2: a Partial/Replicate DTensor
        loss_t = torch.as_tensor(loss, dtype=torch.float32).detach().to(device).reshape(())
        norm_t = torch.as_tensor(grad_norm, dtype=torch.float32).detach().to(device).reshape(())
        return loss_t, norm_t

    def _reset_probes(self) -> None:
        self._counter.reset()
        for probe in (self._forward, self._grads):
            if probe is not None:
                probe.reset()

    # ------------------------------------------------------------------ bad path

    def _bad_step(self, step: int, loss: float, grad_norm: float, batches: list[torch.Tensor], lr: float) -> bool:
        inspection = inspect_model(self.model)
        first_module = self._forward.first_bad() if self._forward else None
        first_grad = self._grads.first_bad() if self._grads else None
        bracket = self.identity.bracket
        device = device_label(torch.device(self._device()), bracket)
        mine = RankRecord(
            rank=self.identity.rank, tag=self.identity.tag, bracket=bracket, host=hostname(), device=device,
            loss=loss, grad_norm=grad_norm, loss_bad=not math.isfinite(loss),
            grad_norm_bad=not math.isfinite(grad_norm), bad_parameters=len(inspection.bad_parameters),
            bad_gradients=len(inspection.bad_gradients),
            first_bad_module=first_module["module"] if first_module else None,
            first_bad_gradient=(first_grad.get("parameter") or first_grad.get("module")) if first_grad else None,
            sharded=inspection.sharded,
        )
        records = gather_records(mine)
        reporters = _reporters(records)
        # Under sharding every flagged rank holds a different piece of the state: all of them dump.
        dumpers = sorted(set(reporters) | {r.rank for r in records if r.flagged and r.sharded})
        origin = [r.rank for r in records if r.evidence] or [r.rank for r in records if r.flagged]

        stop = True
        if self.cfg.debug.nan_policy == "skip":
            self.consecutive_skips += 1
            self.skipped_steps.append(step)
            stop = self.consecutive_skips > self.cfg.debug.max_nan_skips

        report = NanReport(
            bracket=bracket, step=step, loss=loss, grad_norm=grad_norm, lr=lr,
            gradients=inspection.bad_gradients, parameters=inspection.bad_parameters,
            affected_layers=inspection.affected_layers, first_bad_module=first_module,
            first_bad_gradient=first_grad, ranks=[asdict(r) for r in records],
            sharded=inspection.sharded, hooks=self._forward is not None,
        )
        i_report = self.identity.rank in reporters
        if i_report:
            for line in render(report):
                logger.error(line)
        else:
            logger.error(f"{bracket} Non-finite loss/gradients at step {step} produced on rank(s) {origin};"
                         f" full report from rank(s) {reporters}")

        pkl = self._write_dump(step, report, inspection, batches, stop) if self.identity.rank in dumpers else None
        ckpt = self._save_checkpoint(step) if stop else None
        if i_report and ckpt is not None:
            logger.error(f"Checkpoint saved: {_show(ckpt)}")
        if pkl is not None:
            logger.error(f"Debug tensors saved: {_show(pkl)}")
        # The record must stay under PIPE_BUF or the channel drops its fields: cap the list.
        self.status.send("nan", step=step, ranks=origin[:STATUS_RANKS], n_ranks=len(origin),
                         report=str(pkl) if pkl else None,
                         checkpoint=str(ckpt) if ckpt else None, action="stop" if stop else "skip",
                         loss=loss if math.isfinite(loss) else str(loss),
                         grad_norm=grad_norm if math.isfinite(grad_norm) else str(grad_norm))
        if stop:
            self._stop(step, origin, pkl, ckpt)
        logger.warning(f"{bracket} debug.nan_policy=skip: step {step} not applied"
                       f" ({self.consecutive_skips}/{self.cfg.debug.max_nan_skips} in a row,"
                       f" {len(self.skipped_steps)} skipped in all)")
        return False

    def _stop(self, step: int, origin: list[int], pkl: Path | None, ckpt: Path | None) -> NoReturn:
        why = ("debug.nan_policy=stop" if self.cfg.debug.nan_policy == "stop" else
               f"{self.consecutive_skips} non-finite steps in a row > debug.max_nan_skips="
               f"{self.cfg.debug.max_nan_skips}")
        logger.error(f"{self.identity.bracket} Stopping at step {step} ({why}); exit code {int(ExitCode.NAN)}")
        raise NanStop(f"non-finite loss or gradient at step {step} on rank(s) {origin}", step, origin, pkl, ckpt)

    def _device(self) -> torch.device:
        return next((local_tensor(p).device for p in self.model.parameters()), torch.device("cpu"))

    def _world_size(self) -> int:
        return dist.get_world_size() if distributed() else self.identity.world_size

    def _write_dump(self, step: int, report: NanReport, inspection: ModelInspection,
                    batches: list[torch.Tensor], stop: bool) -> Path | None:
        suffix = f"_rank{self.identity.rank}" if self._world_size() > 1 else ""
        path = self.checkpoint_dir / "debug" / f"nan_debug_step_{step}{suffix}.pkl"
        limit_mb = self.cfg.debug.max_dump_mb
        selection = dump.select_tensors(self.model, inspection.affected_layers, limit_mb * 2**20)
        notes = []
        if inspection.sharded:
            notes.append(f"FSDP: rank {self.identity.rank} dumped its local shards; arrays have local shard shapes,"
                         " 'shapes' holds the global ones; load every rank's file for whole tensors")
        if selection.empty_shards:
            notes.append(f"no local elements (empty shards, not dumped): {selection.empty_shards}")
        omitted = dump.omitted_note(selection, limit_mb)
        if omitted:
            notes.append(omitted)
            logger.warning(f"{self.identity.bracket} {omitted}")
        payload = {
            "format": dump.FORMAT,
            "parameters": selection.parameters,
            "gradients": selection.gradients,
            "step": step, "loss": report.loss, "grad_norm": report.grad_norm, "lr": report.lr,
            "rank": self.identity.rank, "world_size": self._world_size(), "tag": self.identity.tag,
            "device": next(r["device"] for r in report.ranks if r["rank"] == self.identity.rank),
            "host": hostname(),
            "batch_token_ids": dump.token_ids(batches),
            "affected_layers": report.affected_layers,
            "first_bad_module": report.first_bad_module,
            "first_bad_gradient": report.first_bad_gradient,
            "ranks": report.ranks,
            "sharded": inspection.sharded,
            "shapes": {f.name: f.shape for f in inspection.parameters},
            "omitted": selection.omitted,
            "max_dump_mb": limit_mb,
            "notes": notes,
            "policy": self.cfg.debug.nan_policy,
            "action": "stop" if stop else "skip",
            "report": asdict(report),
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


def _reporters(records: list[RankRecord]) -> list[int]:
    """Ranks that print the banner and write a dump: those that produced the
    bad values; failing that (all ranks only received NaN gradients through
    the all-reduce, or the norm overflowed) one rank under replication, every
    flagged rank under sharding (each holds different shards)."""
    origin = [r.rank for r in records if r.evidence]
    if origin:
        return origin
    flagged = [r for r in records if r.flagged] or records
    if any(r.sharded for r in flagged):
        return [r.rank for r in flagged]
    return [flagged[0].rank]


def _show(path: Path) -> str:
    """Relative to the working directory, as a user would type it (`.checkpoints/...`),
    when the file is below it, absolute otherwise."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except (OSError, ValueError):
        return str(path)
