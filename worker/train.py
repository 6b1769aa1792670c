"""One training process from start to finish: `run()` and the `Trainer` loop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from loguru import logger

from gpuherd import contract
from gpuherd.config import Config
from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.liveness import Liveness
from gpuherd.memory_plan import Layout
from gpuherd.status_channel import StatusWriter
from worker import distributed as wdist
from gpuherd import rng
from worker import signals as wsignals
from worker.attention import resolve_backend
from worker.checkpoint import Checkpointer, meta_base, run_id_from_env
from worker.data import BatchSource, DataBundle, Prefetched, cache_bundle
from worker.data_slots import draw_position
from worker.distributed import StopVote, WorkerError
from worker.engines import Buckets, Engine, Precision, StepCheck, build_engine, compile_enabled, needs_process_group, plan_layout
from worker.live_recovery import Joining, LiveRecovery, RecoveryParts, join_as_newcomer
from worker.logs import setup_logging
from worker.mfu import FlopsModel
from worker.model import ModelArgs
from worker.reporting import ScalarSinks, StepReporter, TensorBoard
from worker.save_schedule import SaveSchedule
from worker.saver import Saver
from worker.schedule import WarmupCosine
from worker.sdc import Loop, SdcCheck, SdcSettings
from worker.wandb_log import WandbLog
from worker.collectives import GradientSync, dump_collective_trace

if TYPE_CHECKING:
    from worker.nan import NanGuard


def run(cfg: Config, identity: WorkerIdentity, *, cache_dir: Path | None = None, data: DataBundle | None = None,
        status: StatusWriter | None = None, run_dir: Path | None = None, install_signals: bool = True,
        run_id: str | None = None) -> int:
    """Train per `cfg`; returns the exit code (0, or 130 / 143 after a graceful SIGINT / SIGUSR2 stop).
    Failures with a known cause raise WorkerError (or worker.nan.NanStop). `run_id`
    (default: from the environment) goes into every checkpoint."""
    sig = wsignals.install() if install_signals else wsignals.SignalState()
    device, identity = wdist.choose_device(cfg, identity)
    setup_logging(identity, cfg.debug.log_level)  # now the tag says GPU or CPU for sure
    uuid = wdist.check_device_uuid(device, os.environ.get(contract.DEVICE_UUID))
    status = status or StatusWriter.from_env(identity.rank)
    status.send("ready", device=str(device), uuid=uuid, pid=os.getpid())
    wsignals.report_stops(sig, lambda name: status.send("stop", signal=name))
    trace_dir = os.environ.get(contract.TRACE_DIR)
    live = Liveness(status, trace_dir=Path(trace_dir) if trace_dir else None, dump=dump_collective_trace).start()
    try:
        try:
            joining = _join_if_spare(cfg, identity, device, status, live)
        except wdist.RegrowEnded as ended:  # a regrow came too late: nothing to take back
            logger.info(f"{identity.bracket} {ended}: nothing to do")
            status.send("done", step=None)
            return int(ExitCode.OK)
        if identity.world_size > 1 and joining is None:
            _rendezvous(cfg, identity, device, status, live)
        if data is None:
            if cache_dir is None:
                raise WorkerError("no dataset cache given (GPUHERD_DATASET_CACHE)", ExitCode.DATA)
            data = cache_bundle(cache_dir, cfg.model.vocab_size, cfg.training.batch_size, cfg.data.context_length,
                                identity.rank, identity.world_size, cfg.system.seed, cfg.data.verify_cache)
        if joining is not None:  # the survivors' layout, as they planned it
            layout, note = joining.layout, joining.note
        else:  # every rank plans with the smallest GPU of the run, so all choose the same layout
            layout, note = plan_layout(cfg, data.vocab_size, identity.world_size,
                                       wdist.smallest_device_memory(device))
        if identity.world_size == 1 and needs_process_group(layout.strategy):
            _rendezvous(cfg, identity, device, status, live)
        trainer = Trainer(cfg, identity, device, layout, data, status, run_dir, sig, live, note,
                          run_id_from_env() if run_id is None else run_id, joining=joining)
        return trainer.train()
    finally:
        live.stop()
        wdist.shutdown()


def _rendezvous(cfg: Config, identity: WorkerIdentity, device: torch.device, status: StatusWriter,
                live: Liveness) -> None:
    status.send("phase", name="rendezvous")
    live.at("rendezvous")
    wdist.init_process_group(cfg, identity, device)


def _join_if_spare(cfg: Config, identity: WorkerIdentity, device: torch.device, status: StatusWriter,
                   live: Liveness) -> Joining | None:
    """A warm spare given a lost rank (GPUHERD_JOIN_GENERATION): join the survivors' rebuilt group."""
    generation = int(os.environ.get(contract.JOIN_GENERATION) or 0)
    if generation <= 0:
        return None
    status.send("phase", name="rendezvous")
    live.at("rendezvous")
    return join_as_newcomer(cfg, identity, device, generation)


def _allow_tf32(device: torch.device) -> None:
    """TF32 tensor cores on Ampere and later: matmuls in fp32 run several times faster."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


class Trainer:
    carried: list[tuple[int, BatchSource]]  # a shrunk group: the lost ranks' data slots this one trains too
    carried_micro_losses: list[torch.Tensor]  # the last step's micro-batch losses of the slots carried
    drawn: list[int] | None  # debug.record_samples: the last step's draws (worker/data_slots.py: draw_position)
    def __init__(self, cfg: Config, identity: WorkerIdentity, device: torch.device, layout: Layout, data: DataBundle,
                 status: StatusWriter, run_dir: Path | None, sig: wsignals.SignalState, live: Liveness,
                 layout_note: str | None = None, run_id: str = "", joining: Joining | None = None) -> None:
        """`joining`: this process is a spare taking a lost rank: no checkpoint is read, the
        state comes from a survivor (worker/live_recovery.py)."""
        self.cfg, self.identity, self.device, self.strategy = cfg, identity, device, layout.strategy
        self.layout, self.layout_note = layout, layout_note
        self.data, self.status, self.sig, self.live = data, status, sig, live
        t = cfg.training
        status.send("phase", name="init")
        live.at("init")
        _allow_tf32(device)
        rng.seed_everything(cfg.system.seed)
        precision = Precision.choose(cfg, device)
        attention, why = resolve_backend(cfg.model.attention, device, precision.autocast_dtype)
        self.args = ModelArgs.from_config(cfg.model, data.vocab_size, cfg.data.context_length)
        if compile_enabled(cfg, device):
            status.send("phase", name="compile")
            live.at("compile")
        self.engine: Engine = build_engine(cfg, self.args, layout, device, attention, identity.world_size,
                                           joining=joining is not None,
                                           buckets=joining.buckets if joining is not None else None)
        self.sync = GradientSync(self.engine.inner, layout.strategy, identity.world_size, live)
        self._log_rank0(self._model_line(precision, attention, why))
        self.flops = self._flops_model()
        self.schedule, self.saves = WarmupCosine.from_config(t), SaveSchedule.of(t)  # the learning rate; the saves
        self.checkpointer = Checkpointer(
            self.engine, Path(cfg.system.checkpoint_dir), t.keep_last, identity.rank, identity.world_size,
            meta_base(self.args, cfg.to_dict(), self.schedule.state_dict(), data.tokenizer), run_id)
        self.start_step = self._resume() if joining is None else 0
        self.saver = Saver(self.checkpointer, status, live, identity.bracket, t.async_save and self.saves.periodic_saves,
                           cfg.system.stop_timeout, agreed=None if joining is None else (joining.saves_blocking,))
        self.step = self.saved_step = self.start_step
        if t.num_workers:  # after the resume: the sampler is at its restored position
            data.train = Prefetched(data.train, t.num_workers, pin=device.type == "cuda")
        self.guard = self._nan_guard()
        self.vote = StopVote.create()
        self.run_dir = run_dir
        self.tb = self._scalar_sinks(identity.rank)
        tokens_per_step = t.batch_size * t.grad_accum_nums * cfg.data.context_length
        self.reporter = StepReporter(identity, t.max_steps, t.log_every, tokens_per_step, self.flops, status, self.tb,
                                     device, self.start_step, note=self.saver.step_note, on_end=self.saver.step_ended)
        if data.describe is not None:  # what this run reads: sources, shares, epochs over max_steps
            self._log_rank0(f"{identity.bracket} {data.describe(tokens_per_step * identity.world_size * t.max_steps)}")
        self.skipped_steps, self.carried, self.carried_micro_losses, self.drawn = 0, [], [], None
        self.owed: list[str] = []  # "eval", "checkpoint": due after the last completed step, not done yet
        self.recovery = LiveRecovery(self._recovery_parts(), self, joining)
        if joining is not None:
            self.recovery.join(joining)
            self.reporter.restart_window(self.step)

    def _model_line(self, precision: Precision, attention: str, why: str) -> str:
        """What this run trains, in the one line rank 0 prints: size, layout, attention, precision."""
        args, identity, layout_note = self.args, self.identity, self.layout_note
        return (f"{identity.bracket} model: {self.engine.n_params / 1e6:.2f}M parameters, {args.n_layers} layers, "
                f"dim {args.dim}, vocab {args.vocab_size} | strategy {self.layout.describe()} "
                f"x{identity.world_size}{f' ({layout_note})' if layout_note else ''} | "
                f"attention {attention} ({why}) | "
                f"precision {precision.autocast_dtype or 'fp32'}{' + grad scaler' if precision.use_scaler else ''}"
                f"{' | compiled per block' if compile_enabled(self.cfg, self.device) else ''}")

    def _flops_model(self) -> FlopsModel:
        """The FLOPs per token of this model, and the peak of this device (MFU's two halves)."""
        device = self.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return FlopsModel.for_model(self.engine.n_matmul_params, self.args.n_layers,
                                    self.args.n_heads, self.args.head_dim, self.cfg.data.context_length, name)

    def _log_rank0(self, message: str) -> None:
        if self.identity.rank == 0:
            logger.info(message)

    def _scalar_sinks(self, group_rank: int) -> ScalarSinks:
        """The run's scalars (TensorBoard, W&B offline), written by the group's place 0 only."""
        return ScalarSinks(TensorBoard(self.run_dir, group_rank),
                           WandbLog(self.cfg.logging.wandb, self.run_dir, group_rank, self.cfg.to_dict()))

    # ------------------------------------------------------------------ what live recovery asks of it
    def _recovery_parts(self) -> RecoveryParts:
        return RecoveryParts(self.cfg, self.identity, self.device, self.layout, self.layout_note, self.engine,
                             self.status, self.live, self.saver, self.reporter)

    def data_position(self) -> dict[str, Any]:
        """Where the training data stands (the sampler's state): what a rewind puts back."""
        return self.data.train.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """The loop's counters, and what a lost peer cut short (`owed`): what a survivor hands a
        rebuilt group besides model and data, so every rank of it does the same collectives."""
        return {"step": self.step, "saved_step": self.saved_step, "skipped_steps": self.skipped_steps,
                "owed": list(self.owed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.saved_step = int(state["step"]), int(state["saved_step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.owed = list(state.get("owed", []))

    def on_group_lost(self) -> None:
        """A peer broke the group: let go of everything that holds it (the stop vote, the
        engine's wrapper), so that its connections close."""
        self.vote = StopVote(None)
        self.engine.drop_group()
        if self.guard is not None:
            self.guard.model = self.engine.model

    def on_regroup(self, buckets: Buckets | None) -> None:
        """A rebuilt group formed: the objects bound to a group, over the new one (`buckets`: the
        gradient buckets every rank of it reduces in). The groups are made in the order a newcomer's
        constructor makes them: the saver's, then the stop vote's."""
        self.saver.regroup()
        self.vote = StopVote.create()
        self.engine.regroup(buckets)
        if self.guard is not None:
            self.guard.model = self.engine.model

    def on_slots(self, carried: list[int], scale: float) -> None:
        """The group shrank (no spare left) or grew back (a regrow): this process also trains the
        lost ranks' data slots `carried` (none: its own only), and every loss is multiplied by
        `scale` so DDP's mean over the group is the mean over all slots (worker/data_slots.py);
        `rewind_data` puts them at the group's position."""
        if carried and self.data.for_slot is None:
            raise WorkerError(f"{self.identity.bracket} cannot carry data slot(s) {carried}: this data source has "
                              "no per-slot sampler", ExitCode.FAILURE)
        kept = dict(self.carried)  # a slot carried already keeps its sampler (rewound all the same)
        self.carried = [(slot, kept[slot] if slot in kept else self.data.for_slot(slot)) for slot in carried]
        self.engine.grad_accum = self.cfg.training.grad_accum_nums / scale
        if carried:
            logger.info(f"{self.identity.bracket} carries the data slot(s) of rank(s) {', '.join(map(str, carried))} "
                        f"too: {len(carried) + 1} x {self.cfg.training.grad_accum_nums} micro-batch(es) per step")

    def on_place(self, group_rank: int) -> None:
        """This process's place in a rebuilt group (a shrink, a regrow). Place 0 leads: it writes the
        one-file checkpoints, prunes them, and writes the run's scalars. A shrink that lost rank 0
        hands that to the lowest survivor; a regrow that brings rank 0 back hands it back (the
        newcomer, rank 0, is place 0 again), so one rule, the group's first rank, says who leads."""
        was = self.checkpointer.group_rank
        self.checkpointer.group_rank = group_rank
        if (was == 0) == (group_rank == 0):
            return
        self.tb.close()  # the former lead's event file and W&B run end here; the new lead's begin
        self.tb = self.reporter.tb = self._scalar_sinks(group_rank)
        if group_rank == 0:
            self.saver.take_lead()
            logger.info(f"{self.identity.bracket} leads the shrunk group in rank 0's place: it writes the "
                        "checkpoints and the run's scalars from now on")

    def rewind_data(self, sampler: dict[str, Any]) -> None:
        """The training data back at `sampler`'s position; a prefetching thread that drew ahead is
        replaced by a fresh one over the rewound source."""
        for slot, carried in self.carried:  # every slot is at the same position, but for its rank
            carried.load_state_dict({**sampler, "rank": slot})
        source = self.data.train
        if isinstance(source, Prefetched):
            source.close()
            source.source.load_state_dict(sampler)
            self.data.train = Prefetched(source.source, source.depth, source.pin)
        else:
            source.load_state_dict(sampler)

    # ------------------------------------------------------------------ setup helpers
    def _resume(self) -> int:
        self.checkpointer.remove_orphans()
        want = self.cfg.training.resume
        # a restarted attempt: the supervisor's pick, which must be this run's own checkpoint
        restored = self.checkpointer.resume(want, handed=os.environ.get(contract.RESUME))
        if restored is None:
            if want == "auto":
                self._log_rank0(f"resume=auto: no checkpoint in {self.cfg.system.checkpoint_dir}, starting at step 0")
            return 0
        if restored.sampler_state is not None:
            self.data.train.load_state_dict(restored.sampler_state)
        self._log_rank0(f"resumed from {restored.path} at step {restored.step}")
        return restored.step

    def _nan_guard(self) -> NanGuard | None:
        if not self.cfg.debug.nan_detection:
            return None
        try:
            from worker.nan import NanGuard
        except ImportError:
            logger.warning("debug.nan_detection is on but worker.nan is missing from this tree: no NaN checks")
            return None
        guard = NanGuard(self.cfg, self.engine.model, self.identity, self.status, self._save_for_guard,
                         scaler=self.engine.scaler, live=self.live)
        guard.attach()
        return guard

    def _sdc_check(self) -> SdcCheck:
        """The check's parts: the loop's counters and data position, which its rollback puts back."""
        loop = Loop(step=lambda: self.step, counters=self.state_dict, load_counters=self.load_state_dict,
                    data_position=self.data_position, rewind_data=self.rewind_data,
                    exclude_pause=self.reporter.exclude_pause)
        return SdcCheck(SdcSettings.of(self.cfg.training, self.saves, self.strategy), self.engine, self.identity,
                        self.device, self.status, self.live, self.recovery, loop)

    def _save_for_guard(self, path: Path) -> None:
        # inside a step, but as long as any save: the step's learned allowance must not cover it
        with self.live.phase("checkpoint"):
            self.saver.drain_or_raise()  # the stop that follows must not cut a periodic save short
            self.checkpointer.save(self.step, self.data.train.state_dict(), path=Path(path))

    # ------------------------------------------------------------------ the loop
    def train(self) -> int:
        try:
            return self._train()
        finally:
            self.saver.close()  # a write still in flight (an exception left the loop) may finish
            if isinstance(self.data.train, Prefetched):
                self.data.train.close()

    def _train(self) -> int:
        t = self.cfg.training
        self.status.send("phase", name="train")
        self.engine.train()
        self.sdc = self._sdc_check()  # replicas compared after optimizer steps (worker/sdc/)
        self.recovery.announce()
        self.recovery.mark()
        stopped = False
        while self.step < t.max_steps or self.owed:
            try:
                if self.owed:  # after a rebuilt group: what the lost peer cut short
                    self.settle_owed()
                    continue
                if self._iteration():
                    stopped = True
                    break
                continue
            except Exception as exc:  # a peer lost mid-collective: rejoin the rebuilt group, or fail as before
                if not self.recovery.can_rejoin(exc):
                    raise
                lost = " ".join(str(exc).split())[:200]
            # out of the handler: the exception's frames, which hold the broken group, are gone
            self.recovery.rejoin(lost)
        self.recovery.close_regrow()
        if self.step != self.saved_step:  # a stop right after a save (or before any step) has nothing new to save
            self._paused("checkpoint", lambda: self.save(final=True), back_to=None)
        else:  # that save may still be on its way to disk: the run is not over before it is
            self._paused("checkpoint", self._finish_write, back_to=None)
        if (saves := self.saver.summary()) is not None:
            logger.info(f"{self.identity.bracket} {saves}")
        self.tb.close()
        if stopped:
            logger.info(f"{self.identity.bracket} stopped after {self.step} steps, as asked "
                           f"(exit {int(self.sig.stop_code)})")
            self.status.send("phase", name="shutdown")
            return int(self.sig.stop_code)
        if self.skipped_steps:
            logger.warning(f"{self.identity.bracket} {self.skipped_steps} optimizer step(s) skipped"
                           " as suspicious (non-finite or a spike)")
        self.live.stop()  # `done` is the last record a finished rank sends
        self.status.send("done", step=self.step)
        return int(ExitCode.OK)

    def _iteration(self) -> bool:
        """One step and what follows it (eval, save); True when the ranks agreed to stop."""
        self.live.step(self.step)
        regrow = self.recovery.regrow_due()  # a shrunk group: a warm spare waits to take back a carried rank
        with self.live.collective("all_reduce (stop vote)"):  # 143 wins over 130: a stop request is a stop request
            stop_code, regrow = self.vote.highest(int(self.sig.stop_code) if self.sig.stop_requested else 0, regrow)
        if stop_code:
            self.sig.stop_code = stop_code
            return True
        if regrow:  # every rank heard it in the vote: all rebuild the group at this step boundary
            self.recovery.regrow(regrow)
            return False
        self.saver.poll()  # a background write that failed (a full disk) ends the run here
        self._train_step()
        self.step += 1
        # The mark comes before the SDC check's collective: a peer lost there is lost after a
        # completed step, which the rebuilt group must not do again (its update is in the model).
        self.recovery.mark()
        # Owed from here on: a peer lost in the SDC check's collective leaves this step's eval and
        # save to the rebuilt group (its counters carry `owed`), instead of dropping them.
        self.owed = self._due_after(self.step)
        if self.sdc.after_step(self.step - 1):  # silent data corruption: rolled back to the replicas' last agreed state
            self.owed = []  # as before a rollback: nothing of the rolled-back step is done
            self.recovery.mark()  # a rejoin now rewinds to that state
            return False
        self.settle_owed()
        return False

    def _due_after(self, step: int) -> list[str]:
        """What follows step `step`: its evaluation and its periodic checkpoint, in that order."""
        t, due = self.cfg.training, []
        if t.eval_every and step % t.eval_every == 0 and self.data.make_val is not None:
            due.append("eval")
        if self.saves.periodic_after(step):
            due.append("checkpoint")
        return due

    def settle_owed(self) -> None:
        """Do what is owed after the last completed step. A peer lost in the middle leaves the rest
        owed: the rebuilt group does it, newcomer included (worker/live_recovery.py hands the list
        over with the state), so no evaluation or periodic save is silently dropped."""
        while self.owed:
            self._paused(self.owed[0], self.evaluate if self.owed[0] == "eval" else self.save)
            self.owed.pop(0)

    def _train_step(self) -> None:
        t, engine, step = self.cfg.training, self.engine, self.step
        lr = self.schedule(step)
        if self.guard is not None:
            self.guard.begin_step(self.data.train)  # where the batches come from (+ RNG state for a replay)
        self.live.doing("data loading")
        self.drawn = [] if self.cfg.debug.record_samples else None
        batches = [self._next_batch(self.identity.rank) for _ in range(t.grad_accum_nums)]
        carried = [self._next_batch(slot, source) for slot, source in self.carried for _ in range(t.grad_accum_nums)]
        loss = self._micro_steps(batches, carried)
        check = None if self.guard is None else self._step_check(step, loss, batches, lr, carried)
        self.recovery.before_update()  # the shard copies sent after the last step have arrived (FSDP)
        self.live.doing("optimizer step")
        grad_norm, applied = engine.step(lr, t.max_grad_norm, check)
        if self.guard is not None:
            loss, grad_norm = self.guard.retried or (loss, grad_norm)  # a retried step: the replay's values
        if not applied:
            self.skipped_steps += 1
        self.reporter.after_step(step, loss, lr, grad_norm, carried=self._carried_losses(), samples=self.drawn)

    def _carried_losses(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, mean loss) of every data slot carried in this step: logged beside the rank's own."""
        n = self.cfg.training.grad_accum_nums
        losses = self.carried_micro_losses
        return [(slot, torch.stack(losses[i * n:(i + 1) * n]).mean()) for i, (slot, _) in enumerate(self.carried)]

    def _next_batch(self, slot: int, source: BatchSource | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        source = source or self.data.train
        inputs, targets = source.next_batch()
        if self.drawn is not None:  # debug.record_samples: which windows, by the sampler's position after the draw
            self.drawn += draw_position(slot, source.state_dict())
        if self.device.type == "cuda":  # pinned (by the prefetcher, or here): the copy overlaps compute
            inputs, targets = (x if x.is_pinned() else x.pin_memory() for x in (inputs, targets))
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
        return inputs, targets

    def _micro_steps(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     carried: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
        """Forward + backward of every micro-batch (`carried`: a lost rank's slot, after this rank's
        own, before the one synchronised backward); the mean loss of this rank's own."""
        self.live.doing("forward/backward")
        every = [*batches, *carried]
        last, losses = len(every) - 1, []
        for i, (x, y) in enumerate(every):
            with self.sync.micro_step(syncs=i == last):
                losses.append(self.engine.micro_step(x, y, is_last=i == last))
        self.carried_micro_losses = losses[len(batches):]
        return torch.stack(losses[:len(batches)]).mean()

    def _step_check(self, step: int, loss: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]],
                    lr: float, carried: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> StepCheck:
        """The guard's verdict, which the engine asks for once the step's gradient norm is known.
        `clip_again` (None once the optimizer has stepped) lets the guard replay the step."""
        def check(grad_norm: torch.Tensor | None, clip_again: Callable[[], torch.Tensor] | None) -> bool:
            replay = None if clip_again is None else (lambda: (self._micro_steps(batches, carried), clip_again()))
            return self.guard.check(step=step, loss=loss, grad_norm=grad_norm, batches=batches, lr=lr, replay=replay)
        return check

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

    def _finish_write(self) -> None:
        self.status.send("phase", name="checkpoint")
        self.saver.drain_or_raise()

    def save(self, final: bool = False) -> None:
        """A checkpoint of the state after this step: copied, then written in the background,
        or written now (`final`, or async off; worker/saver.py)."""
        entered, wall = time.perf_counter(), time.time()  # one moment, on both clocks: the save's cost starts here
        self.status.send("phase", name="checkpoint", at=wall)
        self.saver.save(self.step, self.data.train.state_dict(), final=final, entered=entered)
        self.saved_step = self.step
