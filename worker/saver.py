"""The training loop's one door to checkpoints (docs/design/checkpoints.md).

`training.async_save` (on by default): a periodic save blocks the loop only while the
state is captured (the collectives that gather it) and copied to host memory; a background
write (worker/checkpoint_writer.py) then writes, fsyncs, checksums and publishes it with its
manifest while training goes on. One-file layouts (single, ddp, zero1) are written by rank 0
alone: the copy goes into shared buffers kept from save to save (worker/save_snapshot.py),
which the writer process forked once at the start (worker/save_writer.py: none of the
loop's GIL, the lowest CPU priority) writes from. Sharded ones (fsdp) are copied by torch's
stager (worker/staging.py) and written by every rank, in writer threads that agree through
a gloo process group of their own, so the loop's collectives and theirs never share a
connection.

- At most one write is in flight: the next save first waits for it (counted, said, and
  in its `checkpoint` record as `wait_s`).
- A write that failed is raised at the loop's next step (`poll`): a full disk is exit 7
  there, not lost in the thread.
- The final save (end of training, a graceful stop) is written while the loop waits, after
  the write in flight; so is every save where async is off or unsafe: DeepSpeed (its engine
  saves itself), a torch without DefaultStager, or staging buffers larger than half the
  host's available memory (all ranks agree on the mode).
- Leaving for any other reason (an exception, SIGTERM from a teardown) first waits up to
  `system.stop_timeout` for the write in flight and says whether it completed.

The checkpoint becomes visible to `--resume` only once published (manifest included); the
`checkpoint` status record, sent then, carries `stall_s` (the loop blocked), `wait_s`
(the part of it spent waiting for the previous write), `write_s` (the write itself) and
`mode` (`async` | `blocking`). What the save cost the loop in all, its slower steps while the
write was in flight included, is measured on the loop's step times (worker/save_cost.py)
and sent once known, at the first step end after the write ended (a save written while the
loop waited: when it returns): a `checkpoint_write` record with `state` `accounted` and `cost_s`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from loguru import logger

from gpuherd.liveness import Liveness
from gpuherd.model_size import checkpoint_bytes
from gpuherd.status_channel import StatusWriter
from worker import distributed as wdist
from worker import save_phases
from worker import signals as wsignals
from worker.checkpoint import Capture, Checkpointer
from worker.checkpoint_io import directly_to_disk
from worker.checkpoint_writer import BackgroundWrite, written_here
from worker.save_cost import Closed, LoopCost
from worker.save_snapshot import Snapshot, SnapshotTaker, TooLarge, rebuild, reserve_bytes
from worker.save_stats import SaveStats
from worker.save_writer import WriterProcess
from worker.staging import HostStager, memory_problem, stager_missing


class Saver:
    def __init__(self, checkpointer: Checkpointer, status: StatusWriter, live: Liveness, bracket: str,
                 want_async: bool, exit_wait_s: float, agreed: tuple[str | None] | None = None) -> None:
        """`want_async`: off where no save is periodic (the final one blocks anyway, and no writer
        process is started for nothing). `agreed`: the ranks' verdict on blocking saves, when it
        was taken without this rank (a spare replacing a lost rank: worker/live_recovery.py),
        instead of agreeing on it now."""
        self.ckpt, self.status, self.live, self.bracket = checkpointer, status, live, bracket
        self.exit_wait_s = exit_wait_s
        self.stats = SaveStats()
        self.inflight: BackgroundWrite | None = None
        self._raised: BackgroundWrite | None = None  # the failed write the loop raised last (`cut_short`)
        self._lock = threading.Lock()  # the writer thread's reports vs the loop's reads of stats
        why_not = agreed[0] if agreed is not None else self._why_blocking(want_async)
        self.why_blocking = why_not
        self.background = why_not is None
        if why_not and want_async:
            self._log0(f"{bracket} checkpoints are written while the loop waits: {why_not}")
        engine = checkpointer.engine
        engine.prepare_capture()
        self.cost = LoopCost()
        sharded = self.background and engine.sharded
        self.stager = HostStager(engine.device) if sharded else None
        # DCP's collectives from a writer thread need a group of their own (gloo: DCP
        # coordinates on the CPU), created now, at the same point on every rank.
        self.group = dist.new_group(backend="gloo") if self.background and engine.sharded and wdist.active() else None
        self.snapshots: SnapshotTaker | None = None
        self.writer: WriterProcess | None = None
        if self.background and not sharded and checkpointer.group_rank == 0:  # the rank that writes one-file layouts
            self._start_writer()  # before training: it shares only the pages of this moment (worker/save_writer.py)
        wsignals.before_exit_now(self._before_exit)

    def _start_writer(self) -> None:
        """Fork the writer, once every field it uses is set: the child keeps the saver as it was at the fork."""
        engine = self.ckpt.engine
        expected = checkpoint_bytes(engine.n_params)
        self.snapshots = SnapshotTaker(engine.device, reserve_bytes(expected, self.ckpt.world_size), expected)
        self.writer = WriterProcess(self._write_snapshot, lambda: self.snapshots.region.populate(
            self.snapshots.expected))

    def cut_short(self) -> int | None:
        """A peer was lost and this rank has left the broken group: a sharded write in flight, whose
        DCP collectives ran on that group, ends (it fails, or it had finished). The step of one
        that failed (the rebuilt group writes it again: worker/live_recovery.py), else None."""
        # the loop may have met the write's failure first (`poll`, `drain_or_raise`): it is the
        # lost peer's doing all the same, and that save is owed just as much
        write, self._raised = self.inflight or self._raised, None
        if self.group is None or write is None:
            return None
        write.wait(self.exit_wait_s)
        self.inflight = None
        if write.done and write.error is None:
            return None
        logger.warning(f"{self.bracket} the background write of the checkpoint of step {write.step} was cut short by "
                       f"the lost peer ({write.path.name} stays invisible to --resume)")
        return write.step

    def regroup(self) -> None:
        """Live recovery rebuilt the process group: DCP's writer group anew over it, created where a
        newcomer creates its own (in its constructor: before the stop vote's), so both match."""
        if self.group is not None:
            self.group = dist.new_group(backend="gloo")

    def take_lead(self) -> None:
        """This process became place 0 of a shrunk group (rank 0 was lost, worker/live_recovery.py):
        it writes the one-file checkpoints from now on. Its background writer starts now (the pages
        it shares are copied once, in the next step, as at a start); where the host cannot hold the
        copies it writes its saves while the loop waits, said once."""
        if not self.background or self.ckpt.engine.sharded or self.writer is not None:
            return
        engine = self.ckpt.engine
        problem = memory_problem(checkpoint_bytes(engine.n_params), copies=2 if engine.device.type == "cpu" else 1)
        if problem is not None:
            logger.info(f"{self.bracket} checkpoints are written while the loop waits on this rank, which took over "
                        f"rank 0's saves: {problem}")
            return
        self._start_writer()

    def _why_blocking(self, want_async: bool) -> str | None:
        """Why saves must block on this run (every rank agrees), None: they need not."""
        engine = self.ckpt.engine
        mine = None
        if not want_async:
            mine = "training.async_save is off"
        elif not engine.async_capable:
            mine = f"strategy {engine.strategy} saves through its own engine"
        elif engine.sharded and (missing := stager_missing()):  # one-file layouts copy without it
            mine = missing
        else:
            share = checkpoint_bytes(engine.n_params) // (self.ckpt.world_size if engine.sharded else 1)
            # The writer process (one-file layouts) on a CPU run also shares the pages the state
            # had when it was forked: each one training rewrites is copied once more.
            forked_on_cpu = not engine.sharded and engine.device.type == "cpu"
            mine = memory_problem(share if engine.sharded or self.ckpt.group_rank == 0 else 0,
                                  copies=2 if forked_on_cpu else 1)
        reasons = [r for r in wdist.gather_objects(mine) if r]
        return reasons[0] if reasons else None

    def _log0(self, message: str) -> None:
        if self.ckpt.group_rank == 0:
            logger.info(message)

    # ------------------------------------------------------------------ the loop's calls
    def save(self, step: int, sampler_state: dict[str, Any], final: bool = False,
             entered: float | None = None) -> None:
        """Save the state after `step` (a collective: all ranks call). `final`: the last save
        of this run, written before returning. `entered`: when the loop entered the save
        (perf_counter, the moment its `phase checkpoint` record shows); default: now."""
        started = time.perf_counter() if entered is None else entered
        self._account(self.cost.close(started))  # the previous save's window ends where this one begins
        self.cost.open(step, started)
        wait_s = self.drain_or_raise()
        if not self.background or final:
            self._write_now(self.ckpt.capture(step, sampler_state), started, wait_s, collective=True)
            return
        save_phases.reached("staging", step)
        with self.live.collective("the state capture (every rank's data position and RNG)"):
            capture = self.ckpt.capture(step, sampler_state, to_host=False)  # waits for the peers: not this rank's hang
        self.live.doing("copying the state to host memory")
        if capture.states is None and not self.ckpt.engine.sharded:
            self._staged(time.perf_counter() - started, wait_s)  # place 0 writes this one alone
            return
        if self.writer is None and not self.ckpt.engine.sharded:  # took over rank 0's saves, no memory for a writer
            self._write_now(capture, started, wait_s)
            return
        if self.writer is not None:
            try:
                snapshot = self.snapshots.take({"meta": capture.meta, "states": capture.states})
            except TooLarge as exc:  # a state that outgrew its estimate: this save is written now
                self._log0(f"{self.bracket} checkpoint of step {step} written while the loop waits: {exc}")
                self._write_now(capture, started, wait_s)
                return
            write, pid = (lambda: self.writer.write(capture.path, step, snapshot)), self.writer.pid
        else:
            copied = dataclasses.replace(capture, meta=self.stager.copy(capture.meta),
                                         states=self.stager.copy(capture.states))
            write, pid = (lambda: written_here(lambda: self._write(copied))), None
        stall = time.perf_counter() - started
        self._staged(stall, wait_s)
        self.status.send("checkpoint_write", state="started", step=step, path=str(capture.path))
        self.inflight = BackgroundWrite(step, capture.path, write, lambda done: self._written(done, stall, wait_s),
                                        writer_pid=pid)

    def _write_now(self, capture: Capture, started: float, wait_s: float, collective: bool = False) -> None:
        """A save written while the loop waits: a blocking or final one (`collective`: every rank
        takes part), or a one-file save that was to go to the background, by place 0 alone."""
        written = written_here(lambda: self.ckpt.write(capture, collective=collective))
        stall = time.perf_counter() - started
        self._published(capture.step, written.path, stall_s=stall, wait_s=wait_s, write_s=stall - wait_s,
                        cpu_s=written.cpu_s, mode="blocking")
        self._account(self.cost.close(time.perf_counter()))  # written while the loop waited: that is its cost

    def _write_snapshot(self, path: Path, step: int, snapshot: Snapshot) -> Path:
        """In the writer process: one save, rebuilt from the shared buffer, whose page-aligned
        tensors go to the disk straight from it."""
        state = rebuild(snapshot, self.snapshots.region.map)
        with directly_to_disk():
            return self._write(Capture(path=path, step=step, meta=state["meta"], states=state["states"]))

    def _write(self, capture: Capture) -> Path:
        save_phases.reached("staged", capture.step)
        return self.ckpt.write(capture, self.group, collective=self.ckpt.engine.sharded)

    def poll(self) -> None:
        """At a step boundary: a finished write is collected, a failed one raised here."""
        if self.inflight is not None and not self.inflight.done:
            return
        self._collect()

    def step_ended(self, at: float) -> None:
        """A step ended at `at` (perf_counter; its step record is sent right after): the open
        save is accounted here once its write ended, as the records show it (a write published
        after this moment is published after the step's record). A failed write stays open:
        the next step's `poll` raises it."""
        write = self.inflight
        ended = write is None or (write.done and write.error is None)
        self._account(self.cost.step_ended(at, ended))

    def drain_or_raise(self) -> float:
        """Wait for the write in flight (the loop is blocked meanwhile); its failure is raised.
        Returns the seconds waited."""
        write = self.inflight
        if write is None:
            return 0.0
        waited = 0.0
        if not write.done:
            started = time.perf_counter()
            self.live.doing(write.describe())  # a writer that never ends is named with its pid and checkpoint
            write.wait()
            waited = time.perf_counter() - started
            self._log0(f"{self.bracket} waited {waited:.2f} s for the checkpoint of step {write.step} to be "
                       "written before going on (saves come faster than the disk takes them)")
        self._collect()
        return waited

    def _collect(self) -> None:
        write, self.inflight = self.inflight, None
        self._raised = write if write is not None and write.error is not None else None
        if self._raised is not None:
            raise write.error

    def close(self) -> None:
        """Leaving the loop, whichever way: the write in flight gets to finish (bounded). The
        SIGTERM hook stays until then: a teardown during this wait must not cut it short."""
        self._wait_in_flight("the run ends")
        if self.inflight is None or self.inflight.done:
            self._account(self.cost.close(time.perf_counter()))
        wsignals.forget_before_exit(self._before_exit)
        for part in (self.writer, self.snapshots, self.stager):
            if part is not None:
                part.close()

    def _before_exit(self) -> None:
        self._wait_in_flight("SIGTERM (a teardown)")

    def _wait_in_flight(self, why: str) -> None:
        write = self.inflight
        if write is None or write.done:
            return
        logger.warning(f"{self.bracket} {why}: waiting up to {self.exit_wait_s:g} s for the checkpoint of step "
                       f"{write.step} being written in the background ({write.path.name})")
        if not write.wait(self.exit_wait_s) or write.error is not None:
            why = f" ({write.error})" if write.error is not None else ""
            logger.error(f"{self.bracket} the checkpoint of step {write.step} was NOT completed{why}: "
                         f"{write.path.name} stays invisible to --resume, which takes the newest complete one")

    def step_note(self) -> str | None:
        """For the next step line: the saves since the previous one."""
        with self._lock:
            return self.stats.step_note()

    def summary(self) -> str | None:
        with self._lock:
            return self.stats.summary()

    # ------------------------------------------------------------------ outcomes
    def _account(self, closed: Closed | None) -> None:
        """A save's cost to the loop, once its window closed (worker/save_cost.py)."""
        if closed is None:
            return
        with self._lock:
            self.stats.account(closed.cost)
        self.status.send("checkpoint_write", state="accounted", step=closed.step, cost_s=round(closed.cost, 4),
                         steps=closed.steps)

    def _staged(self, stall_s: float, wait_s: float) -> None:
        with self._lock:
            self.stats.staged(stall_s, wait_s)

    def _written(self, write: BackgroundWrite, stall_s: float, wait_s: float) -> None:
        """In the writer thread, once its write ended."""
        if write.error is None:
            self._published(write.step, write.published, stall_s=stall_s, wait_s=wait_s, write_s=write.write_s,
                            cpu_s=write.cpu_s, mode="async")
            return
        # said once, by the loop that raises it at its next step (or by the exit that waited for it)
        self.status.send("checkpoint_write", state="failed", step=write.step, path=str(write.path))

    def _published(self, step: int, path: Path, *, stall_s: float, wait_s: float, write_s: float,
                   cpu_s: float, mode: str) -> None:
        with self._lock:
            self.stats.published(stall_s, wait_s, write_s, background=mode == "async", cpu_s=cpu_s)
        how = (f"written in the background in {write_s:.2f} s, the loop blocked {stall_s:.2f} s" if mode == "async"
               else f"the loop blocked {stall_s:.2f} s")
        self._log0(f"{self.bracket} checkpoint saved: {path} ({how})")
        self.status.send("checkpoint", step=step, path=str(path), stall_s=round(stall_s, 4),
                         wait_s=round(wait_s, 4), write_s=round(write_s, 4), write_cpu_s=round(cpu_s, 4), mode=mode)
