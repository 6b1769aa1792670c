"""Step lines, status records and TensorBoard scalars - without a GPU sync per step.

Loss and grad norm stay tensors on the device; they are read (one sync) only
on the steps that are logged. Tokens/s and MFU are averaged over the window
since the previous logged step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import torch
from loguru import logger

from gpuherd.contract import WorkerIdentity
from gpuherd.log_writes import DISK_ERRNOS, quiet_writer_thread_disk_errors
from gpuherd.status_channel import StatusWriter
from gpuherd.text import format_duration
from worker.mfu import FlopsModel
from worker.wandb_log import WandbLog

HEARTBEAT_S = 5.0  # at most this long between status records while training


def step_line(bracket: str, step: int, max_steps: int, loss: float, lr: float, grad_norm: float | None,
              eta_s: float, tokens_per_s: float, flops: FlopsModel) -> str:
    norm = "n/a" if grad_norm is None else f"{grad_norm:.4f}"
    line = (f"{bracket} Step [{step}/{max_steps}] | Loss: {loss:.4f} | LR: {lr:.2e} | Grad Norm: {norm} | "
            f"ETA: {format_duration(eta_s)} | Tok/s: {tokens_per_s:.0f}")
    mfu = flops.mfu(tokens_per_s)
    if mfu is None:  # unknown peak (CPU, unlisted GPU): report achieved TFLOP/s only
        return f"{line} | MFU: n/a | TFLOP/s: {flops.tflops(tokens_per_s):.3f}"
    return f"{line} | MFU: {100 * mfu:.1f}%"


def memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(psutil.Process().memory_info().rss)


class TensorBoard:
    """Scalars from rank 0 to <run_dir>/tensorboard when tensorboard is installed."""

    name = "TensorBoard"

    def __init__(self, run_dir: Path | None, rank: int) -> None:
        self.writer = None
        self.where = None if run_dir is None else run_dir / "tensorboard"
        if rank != 0 or self.where is None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.debug("tensorboard not installed: no event files")
            return
        # SummaryWriter flushes from its own thread: adding scalars never blocks a step. A disk
        # error there ends that thread and is raised again at the next scalar (ScalarSinks drops
        # the sink then); its own traceback on the way out says nothing more.
        quiet_writer_thread_disk_errors()
        try:
            self.writer = SummaryWriter(log_dir=str(self.where))
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            logger.warning(f"TensorBoard cannot write to {self.where}: {DISK_ERRNOS[exc.errno]}; no event files, "
                           "training goes on")

    def scalars(self, step: int, **values: float | None) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def abandon(self) -> None:
        """Its disk failed: closing would only flush into the same error."""
        self.writer = None


class ScalarSinks:
    """Every scalar to every sink (TensorBoard, W&B offline): one call site in the reporter.
    A log disk that fills up never stops the training: a sink whose disk fails (full, quota,
    read-only, I/O error) is dropped with one WARNING, and the scalars it missed are counted."""

    def __init__(self, *sinks: TensorBoard | WandbLog) -> None:
        self.sinks = list(sinks)
        self.gone: list[str] = []  # the dropped sinks' names
        self.dropped = 0  # scalars that never reached a dropped sink

    def scalars(self, step: int, **values: float | None) -> None:
        for sink in list(self.sinks):
            self._guarded(sink, lambda s=sink: s.scalars(step, **values))
        self.dropped += len([v for v in values.values() if v is not None]) * len(self.gone)

    def close(self) -> None:
        for sink in list(self.sinks):
            self._guarded(sink, sink.close)
        if self.dropped:
            logger.warning(f"{self.dropped} scalar(s) could not be written ({', '.join(self.gone)}: the log disk failed)")

    def _guarded(self, sink: TensorBoard | WandbLog, call: Callable[[], None]) -> None:
        try:
            call()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self.sinks.remove(sink)
            self.gone.append(sink.name)
            sink.abandon()
            logger.warning(f"{sink.name} cannot write to {sink.where}: {DISK_ERRNOS[exc.errno]}; its scalars are "
                           "dropped (counted) from now on, training goes on")


class StepReporter:
    def __init__(self, identity: WorkerIdentity, max_steps: int, log_every: int, tokens_per_step: int,
                 flops: FlopsModel, status: StatusWriter, tensorboard: TensorBoard | ScalarSinks, device: torch.device,
                 start_step: int, note: Callable[[], str | None] | None = None,
                 on_end: Callable[[float], None] | None = None) -> None:
        """`note`: asked at each logged step for a field to append (the checkpoints' cost).
        `on_end`: told each step's end (perf_counter), the moment its record shows, so a measure
        on the loop's clock (worker/save_cost.py) marks what the records mark."""
        self.identity, self.max_steps, self.log_every = identity, max_steps, log_every
        self.note, self.on_end = note, on_end
        self.tokens_per_step, self.flops, self.status = tokens_per_step, flops, status
        self.tb, self.device = tensorboard, device
        now = time.perf_counter()
        self.run_start_step, self.run_start = start_step, now
        self.window_step, self.window_start = start_step, now
        self.last_heartbeat = time.monotonic()

    def restart_window(self, step: int) -> None:
        """Throughput from here on: a spare that took a lost rank at `step` trained none before it."""
        self.run_start_step = self.window_step = step
        self.run_start = self.window_start = time.perf_counter()

    def should_log(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps - 1

    def after_step(self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor | None,
                   carried: Sequence[tuple[int, torch.Tensor]] = (), samples: Sequence[int] | None = None) -> None:
        """Called after optimizer step `step` (0-based). `carried`: (data slot, mean loss) of each
        slot a shrunk group's carrier trained besides its own; `samples`: its draws
        (debug.record_samples, worker/data_slots.py: draw_position)."""
        if not self.should_log(step):
            self._ended(time.perf_counter())
            if time.monotonic() - self.last_heartbeat > HEARTBEAT_S:
                self.status.send("step", step=step, max_steps=self.max_steps)
                self.last_heartbeat = time.monotonic()
            return
        slots = [slot for slot, _ in carried]
        together = [loss.float(), *(c.float() for _, c in carried)]
        if grad_norm is not None:
            together.append(grad_norm.float().to(loss.device))
        values = torch.stack(together).tolist()  # one device-to-host copy: the one host sync of a logged step
        loss_v, carried_v = values[0], values[1:1 + len(slots)]
        norm_v = values[-1] if grad_norm is not None else None
        now = time.perf_counter()
        steps = step + 1 - self.window_step
        elapsed = max(now - self.window_start, 1e-9)
        tokens_per_s = steps * self.tokens_per_step / elapsed
        per_step = (now - self.run_start) / max(1, step + 1 - self.run_start_step)
        eta = per_step * (self.max_steps - step - 1)
        line = step_line(self.identity.bracket, step, self.max_steps, loss_v, lr, norm_v, eta, tokens_per_s, self.flops)
        note = self.note() if self.note is not None else None
        if slots:  # the lost ranks' slots this rank trains too: their losses, which no one else logs
            line += " | " + ", ".join(f"carried slot {s} Loss: {v:.4f}" for s, v in zip(slots, carried_v))
        logger.info(f"{line} | {note}" if note else line)
        mfu = self.flops.mfu(tokens_per_s)
        more: dict[str, Any] = {"carried": slots, "carried_loss": carried_v} if slots else {}
        if samples is not None:
            more["samples"] = list(samples)
        record = dict(step=step, max_steps=self.max_steps, loss=loss_v, lr=lr, grad_norm=norm_v,
                      tokens_per_s=tokens_per_s, mfu=mfu, mem_bytes=memory_bytes(self.device), **more)
        ended, wall = time.perf_counter(), time.time()  # one moment, on both clocks
        self._ended(ended)
        self.status.send("step", at=wall, **record)
        self.tb.scalars(step, **{"train/loss": loss_v, "train/lr": lr, "train/grad_norm": norm_v,
                                 "perf/tokens_per_s": tokens_per_s, "perf/mfu": mfu,
                                 "perf/tflops": self.flops.tflops(tokens_per_s)})
        self.window_step, self.window_start = step + 1, time.perf_counter()
        self.last_heartbeat = time.monotonic()

    def _ended(self, at: float) -> None:
        if self.on_end is not None:
            self.on_end(at)

    def exclude_pause(self, seconds: float) -> None:
        """Eval and checkpoint time is not training time: keep it out of Tok/s, MFU and ETA."""
        self.window_start += seconds
        self.run_start += seconds

    def eval_result(self, step: int, val_loss: float) -> None:
        logger.info(f"{self.identity.bracket} Eval [{step}/{self.max_steps}] | Val Loss: {val_loss:.4f}")
        self.status.send("eval", step=step, val_loss=val_loss)
        self.tb.scalars(step, **{"val/loss": val_loss})

    def summary(self) -> dict[str, Any]:
        return {"elapsed_s": time.perf_counter() - self.run_start}
