"""One training process from start to finish: `run()` and the `Trainer` loop."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger

from gpuherd import contract
from gpuherd.checkpoint_layout import latest_checkpoint
from gpuherd.config import Config
from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.liveness import Liveness
from gpuherd.status_channel import StatusWriter
from worker import distributed as wdist
from worker import rng
from worker import signals as wsignals
from worker.attention import resolve_backend
from worker.checkpoint import Checkpointer, meta_base
from worker.data import DataBundle, cache_bundle
from worker.distributed import StopVote, WorkerError
from worker.logs import setup_logging
from worker.mfu import FlopsModel
from worker.model import ModelArgs
from worker.parallelize import Engine, Precision, build_engine, resolve_strategy
from worker.reporting import StepReporter, TensorBoard
from worker.schedule import WarmupCosine
from worker.whereabouts import GradientSync, dump_collective_trace

NEEDS_PROCESS_GROUP = ("ddp", "fsdp", "zero1", "deepspeed")


def run(cfg: Config, identity: WorkerIdentity, *, cache_dir: Path | None = None, data: DataBundle | None = None,
        status: StatusWriter | None = None, run_dir: Path | None = None, install_signals: bool = True) -> int:
    """Train per `cfg`; returns the exit code (0, or 130 after a graceful SIGINT stop).
    Failures with a known cause raise WorkerError (or worker.nan.NanStop)."""
    sig = wsignals.install() if install_signals else wsignals.SignalState()
    device, identity = wdist.choose_device(cfg, identity)
    setup_logging(identity, cfg.debug.log_level)  # now the tag says GPU or CPU for sure
    uuid = wdist.check_device_uuid(device, os.environ.get(contract.DEVICE_UUID))
    status = status or StatusWriter.from_env(identity.rank)
    status.send("ready", device=str(device), uuid=uuid, pid=os.getpid())
    strategy = resolve_strategy(cfg.training.strategy, identity.world_size)
    trace_dir = os.environ.get(contract.TRACE_DIR)
    live = Liveness(status, trace_dir=Path(trace_dir) if trace_dir else None, dump=dump_collective_trace).start()
    try:
        if identity.world_size > 1 or strategy in NEEDS_PROCESS_GROUP:
            status.send("phase", name="rendezvous")
            live.at("rendezvous")
            wdist.init_process_group(cfg, identity, device)
        if data is None:
            if cache_dir is None:
                raise WorkerError("no dataset cache given (GPUHERD_DATASET_CACHE)", ExitCode.DATA)
            data = cache_bundle(cache_dir, cfg.model.vocab_size, cfg.training.batch_size, cfg.data.context_length,
                                identity.rank, identity.world_size, cfg.system.seed, cfg.data.verify_cache)
        trainer = Trainer(cfg, identity, device, strategy, data, status, run_dir, sig, live)
        return trainer.train()
    finally:
        live.stop()
        wdist.shutdown()


class Trainer:
    def __init__(self, cfg: Config, identity: WorkerIdentity, device: torch.device, strategy: str, data: DataBundle,
                 status: StatusWriter, run_dir: Path | None, sig: wsignals.SignalState, live: Liveness) -> None:
        self.cfg, self.identity, self.device, self.strategy = cfg, identity, device, strategy
        self.data, self.status, self.sig, self.live = data, status, sig, live
        t = cfg.training
        status.send("phase", name="init")
        live.at("init")
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # TF32 tensor cores on Ampere+
            torch.backends.cudnn.allow_tf32 = True
        rng.seed_everything(cfg.system.seed)
        precision = Precision.choose(cfg, device)
        attention, why = resolve_backend(cfg.model.attention, device.type, precision.autocast_dtype)
        self.args = ModelArgs.from_config(cfg.model, data.vocab_size, cfg.data.context_length)
        if t.compile:
            status.send("phase", name="compile")
            live.at("compile")
        self.engine: Engine = build_engine(cfg, self.args, strategy, device, attention, identity.world_size)
        self.sync = GradientSync(self.engine.inner, strategy, identity.world_size, live)
        n_params = self.engine.n_params
        self._log_rank0(f"{identity.bracket} model: {n_params / 1e6:.2f}M parameters, {self.args.n_layers} layers, "
                        f"dim {self.args.dim}, vocab {self.args.vocab_size} | strategy {strategy} x{identity.world_size} | "
                        f"attention {attention} ({why}) | "
                        f"precision {precision.autocast_dtype or 'fp32'}{' + grad scaler' if precision.use_scaler else ''}")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.flops = FlopsModel.for_model(self.engine.n_matmul_params, self.args.n_layers,
                                          self.args.n_heads, self.args.head_dim, cfg.data.context_length, name)
        self.schedule = WarmupCosine.from_config(t)
        self.checkpointer = Checkpointer(
            self.engine, Path(cfg.system.checkpoint_dir), t.keep_last, identity.rank, identity.world_size,
            meta_base(self.args, cfg.to_dict(), self.schedule.state_dict(), data.tokenizer))
        self.start_step = self._resume()
        self.step = self.start_step
        self.guard = self._nan_guard()
        self.vote = StopVote.create()
        self.tb = TensorBoard(run_dir, identity.rank)
        tokens_per_step = t.batch_size * t.grad_accum_nums * cfg.data.context_length
        self.reporter = StepReporter(identity, t.max_steps, t.log_every, tokens_per_step, self.flops, status,
                                     self.tb, device, self.start_step)
        self.skipped_steps = 0

    def _log_rank0(self, message: str) -> None:
        if self.identity.rank == 0:
            logger.info(message)

    # ------------------------------------------------------------------ setup helpers
    def _resume(self) -> int:
        want = self.cfg.training.resume
        if want is None:
            return 0
        path = latest_checkpoint(Path(self.cfg.system.checkpoint_dir)) if want == "auto" else Path(want)
        if path is None:
            self._log_rank0(f"resume=auto: no checkpoint in {self.cfg.system.checkpoint_dir}, starting at step 0")
            return 0
        restored = self.checkpointer.load(path)
        if restored.sampler_state is not None:
            self.data.train.load_state_dict(restored.sampler_state)
        self._log_rank0(f"resumed from {path} at step {restored.step}")
        return restored.step

    def _nan_guard(self) -> Any:
        if not self.cfg.debug.nan_detection:
            return None
        try:
            from worker.nan import NanGuard
        except ImportError:
            logger.warning("debug.nan_detection is on but worker.nan is missing from this tree: no NaN checks")
            return None
        guard = NanGuard(self.cfg, self.engine.model, self.identity, self.status, self._save_for_guard)
        guard.attach()
        return guard

    def _save_for_guard(self, path: Path) -> None:
        self.checkpointer.save(self.step, self.data.train.state_dict(), path=Path(path))

    # ------------------------------------------------------------------ the loop
    def train(self) -> int:
        t = self.cfg.training
        self.status.send("phase", name="train")
        self.engine.train()
        stopped = False
        while self.step < t.max_steps:
            self.live.step(self.step)
            with self.live.collective("all_reduce (stop vote)"):
                stop = self.vote.any(self.sig.stop_requested)
            if stop:
                stopped = True
                break
            self._train_step()
            self.step += 1
            if t.eval_every and self.step % t.eval_every == 0 and self.data.make_val is not None:
                self._paused("eval", self.evaluate)
            if t.save_every and self.step % t.save_every == 0 and self.step < t.max_steps:
                self._paused("checkpoint", self.save)
        if self.step > self.start_step:  # a stop before any step has nothing new to save
            self._paused("checkpoint", self.save, back_to=None)
        self.tb.close()
        if stopped:
            logger.warning(f"{self.identity.bracket} stopped by SIGINT after {self.step} steps")
            self.status.send("phase", name="shutdown")
            return int(ExitCode.SIGINT)
        if self.skipped_steps:
            logger.warning(f"{self.identity.bracket} {self.skipped_steps} optimizer step(s) skipped for non-finite values")
        self.status.send("done", step=self.step)
        return int(ExitCode.OK)

    def _train_step(self) -> None:
        t, engine, step = self.cfg.training, self.engine, self.step
        lr = self.schedule(step)
        losses, batches = [], []
        for micro in range(t.grad_accum_nums):
            self.live.doing("data loading")
            inputs, targets = self.data.train.next_batch()
            if self.device.type == "cuda":
                inputs = inputs.pin_memory().to(self.device, non_blocking=True)
                targets = targets.pin_memory().to(self.device, non_blocking=True)
            self.live.doing("forward/backward")
            is_last = micro == t.grad_accum_nums - 1
            with self.sync.micro_step(syncs=is_last):
                losses.append(engine.micro_step(inputs, targets, is_last=is_last))
            if self.guard is not None:
                batches.append(inputs)
        self.live.doing("optimizer step")
        loss = torch.stack(losses).mean()
        grad_norm = engine.clip_grad_norm(t.max_grad_norm)
        apply = True
        if self.guard is not None and engine.ds_engine is None:
            apply = self.guard.check(step=step, loss=loss, grad_norm=grad_norm, batches=batches, lr=lr)
        if apply:
            engine.optimizer_step(lr)
        else:
            engine.skip_step()
            self.skipped_steps += 1
        if engine.ds_engine is not None:
            # DeepSpeed clips inside its step, so its norm (and the NaN check) come after it
            grad_norm = engine.after_step_norm()
            if self.guard is not None and grad_norm is not None:
                self.guard.check(step=step, loss=loss, grad_norm=grad_norm, batches=batches, lr=lr)
        self.reporter.after_step(step, loss, lr, grad_norm)

    def _paused(self, phase: str, fn, back_to: str | None = "train") -> None:
        start = time.perf_counter()
        with self.live.phase(phase):
            fn()
        self.reporter.exclude_pause(time.perf_counter() - start)
        if back_to:
            self.status.send("phase", name=back_to)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over `eval_steps` validation batches; the same batches every time."""
        self.status.send("phase", name="eval")
        self.engine.eval()
        sampler = self.data.make_val()
        total = torch.zeros((), device=self.device)
        for _ in range(self.cfg.training.eval_steps):
            inputs, targets = sampler.next_batch()
            with self.engine.autocast():
                total += self.engine.model(inputs.to(self.device), targets.to(self.device)).float()
        if wdist.active():
            with self.live.collective("all_reduce (eval loss)"):
                dist.all_reduce(total)  # SUM: gloo has no AVG
            total /= dist.get_world_size()
        val_loss = float(total) / self.cfg.training.eval_steps
        self.engine.train()
        self.reporter.eval_result(self.step, val_loss)
        return val_loss

    def save(self) -> Path:
        self.status.send("phase", name="checkpoint")
        path = self.checkpointer.save(self.step, self.data.train.state_dict())
        self._log_rank0(f"{self.identity.bracket} checkpoint saved: {path}")
        self.status.send("checkpoint", step=self.step, path=str(path))
        return path
