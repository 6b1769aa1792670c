"""Training checkpoints: atomic, verified, last-K, resumable bit for bit.

Layouts under `system.checkpoint_dir` (each engine writes its own, see worker/engines/):

- `step_0000100.pt` (single / ddp / zero1): one file written by rank 0
  {"format", "model", "optimizer", "optimizer_format", "meta"}, and its manifest
  `step_0000100.pt.manifest.json` beside it.
- `step_0000100/` (fsdp): torch.distributed.checkpoint shards of
  {"model", "optimizer"} plus `meta.pt` and `manifest.json`.
- `step_0000100/` (deepspeed): DeepSpeed's own files under `ds/` plus `meta.pt` and `manifest.json`.

`meta` holds step, run id, model args, config, LR schedule, tokenizer, world size and,
per rank, the data-sampler state and every RNG state. The manifest (written last)
records the run id and every file's size and digest; resuming verifies it
(worker/resume.py). Everything is written to a temp name that carries the run id and
the writer's pid, fsynced and renamed, so a crash never leaves a checkpoint that
looks complete; a killed save's temp files are removed at the next start. A full or
read-only disk is one line and `ExitCode.STORAGE`. Loads use
`torch.load(weights_only=True, mmap=True)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from gpuherd.checkpoint_layout import checkpoint_name, list_checkpoints, remove_checkpoint, remove_orphans
from gpuherd.checkpoint_manifest import written_by
from gpuherd.exit_codes import ExitCode
from gpuherd.model_size import checkpoint_bytes
from gpuherd.storage import format_bytes, probe_errno, storage_errno, storage_message
from worker import distributed as wdist
from gpuherd import rng
from worker.checkpoint_io import checkpoint_format, read_meta
from worker.distributed import WorkerError
from worker.engines import Engine
from worker.model import ModelArgs
from worker.resume import Picker

# Where a worker learns its run's id: gpuherd's own name first, then torchrun's
# (which is "none" when torchrun was given no --rdzv-id).
RUN_ID_VARS = ("GPUHERD_RUN_ID", "TORCHELASTIC_RUN_ID")


def run_id_from_env() -> str:
    for name in RUN_ID_VARS:
        value = os.environ.get(name, "")
        if value and value != "none":
            return value
    return ""


@dataclass
class Capture:
    """One save between its collective capture and its write: where, which step, the meta
    block and this rank's part of the state (None where this rank writes nothing)."""

    path: Path
    step: int
    meta: dict[str, Any]
    states: dict[str, Any] | None


@dataclass
class Restored:
    path: Path
    step: int
    sampler_state: dict[str, Any] | None


class Checkpointer:
    """Saves and restores the whole training state of one engine (a collective: all ranks call)."""

    def __init__(self, engine: Engine, directory: Path, keep_last: int, rank: int, world_size: int,
                 meta_base: dict[str, Any], run_id: str = "") -> None:
        self.engine, self.directory, self.keep_last = engine, directory, keep_last
        self.rank, self.world_size, self.meta_base, self.run_id = rank, world_size, meta_base, run_id
        # This process's place in the group it saves with; place 0 writes one-file layouts and
        # prunes. It is `rank` until a shrunk group lost rank 0 and its lowest survivor took over
        # (worker/live_recovery.py); `rank` stays the data slot whose sampler and RNG it records.
        self.group_rank = rank

    def remove_orphans(self) -> None:
        """Rank 0 deletes the temp files of saves killed midway (never a live writer's)."""
        if self.rank != 0:
            return
        removed = remove_orphans(self.directory)
        if removed:
            total = format_bytes(sum(size for _, size in removed))
            logger.info(f"removed {len(removed)} temp file(s) of interrupted checkpoint saves from {self.directory} "
                        f"({total}): {', '.join(path.name for path, _ in removed)}")

    # ------------------------------------------------------------------ save
    def save(self, step: int, sampler_state: dict[str, Any], path: Path | None = None) -> Path:
        """Write the state after `step` optimizer steps to `path` (default: the step's name),
        the loop waiting for it."""
        return self.write(self.capture(step, sampler_state, path, to_host=True))

    def capture(self, step: int, sampler_state: dict[str, Any], path: Path | None = None,
                to_host: bool = True) -> Capture:
        """What a save of the state after `step` writes (a collective: all ranks call), before
        anything is written. `to_host` False: the tensors may be the live ones (see Engine)."""
        path = path or self.directory / checkpoint_name(step, self.engine.sharded)
        samplers, rngs = per_slot(wdist.gather_objects((self.rank, sampler_state, rng.capture(self.engine.device))),
                                  self.world_size)
        meta = dict(self.meta_base, step=step, run_id=self.run_id, world_size=self.world_size,
                    strategy=self.engine.strategy, sampler=samplers, rng=rngs)
        return Capture(path=path, step=step, meta=meta, states=self.engine.capture_states(self.group_rank, to_host))

    def write(self, capture: Capture, group: Any = None, collective: bool = True) -> Path:
        """Write a capture, then drop checkpoints past `keep_last`. A collective over `group`
        (from a writer thread: its own process group); `collective` False: rank 0 writes a
        one-file checkpoint alone (place 0 of the group), in the background, the other ranks training on."""
        path = capture.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.engine.write_states(capture.states, path, capture.meta, self.group_rank, group)
        except Exception as exc:
            code = storage_errno(exc) or probe_errno(path.parent)
            if code is None:
                raise
            needed = checkpoint_bytes(self.engine.n_params)
            raise WorkerError(storage_message("checkpoint", path.parent, code, needed), ExitCode.STORAGE) from None
        if collective:
            wdist.barrier(group)  # nobody runs ahead (or prunes) before the checkpoint is complete
        if self.group_rank == 0 and path.parent == self.directory:
            self._prune(keep=path)
        return path

    def _prune(self, keep: Path) -> None:
        """The oldest checkpoints of this run past `keep_last`, never `keep` (the one just
        written, even where the directory holds newer steps of an earlier timeline). Only
        checkpoints whose manifest names this run count: another run sharing the directory
        (or an older gpuherd's checkpoint, which has no manifest) is never deleted."""
        others = [old for _, old in list_checkpoints(self.directory) if old != keep and written_by(old, self.run_id)]
        for old in others[:max(0, len(others) - (self.keep_last - 1))]:
            remove_checkpoint(old)

    # ------------------------------------------------------------------ load
    def resume(self, want: str | None, handed: str | None = None) -> Restored | None:
        """Restore the checkpoint `training.resume` (or, on a restarted attempt, the
        supervisor's `handed` one) names, verified (worker/resume.py); None: start afresh."""
        # Global rank 0's id: it is the one its checkpoints record, and nodes of a multi-node
        # job started without --run-id each name their own run.
        job_id = wdist.gather_objects(self.run_id)[0]
        verdict = Picker(self.directory, job_id, self.rank, self.world_size).pick(want, handed)
        if verdict is None:
            return None
        return self.load(verdict.path, verdict.meta)

    def load(self, path: Path, meta: dict[str, Any] | None = None) -> Restored:
        meta = meta if meta is not None else read_meta(path)
        self._check_compatible(path, meta)
        self.engine.load_states(path, checkpoint_format(path, meta))
        sampler = None
        if meta["world_size"] == self.world_size:
            sampler = meta["sampler"][self.rank]
            rng.restore(meta["rng"][self.rank], self.engine.device)
        else:
            logger.warning(f"checkpoint was written by {meta['world_size']} ranks, resuming with {self.world_size}: "
                           "model and optimizer restored, data order and RNG streams start afresh")
        return Restored(path=path, step=int(meta["step"]), sampler_state=sampler)

    def _check_compatible(self, path: Path, meta: dict[str, Any]) -> None:
        want, have = self.meta_base["model_args"], meta.get("model_args")
        if have != want:
            diff = sorted(k for k in want if (have or {}).get(k) != want[k])
            raise WorkerError(f"checkpoint {path} holds a different model ({', '.join(diff) or 'unknown layout'} differ); "
                              "use the config it was trained with or start without training.resume", ExitCode.USAGE)


def per_slot(gathered: list[tuple[int, Any, Any]], world_size: int) -> tuple[list[Any], list[Any]]:
    """Every rank's (rank, sampler state, RNG state) -> the samplers and RNG states of all
    `world_size` data slots, by rank. A shrunk group (worker/data_slots.py) has fewer processes
    than slots: a lost rank's slot is at the same position as every other (only its `rank`
    differs), so a restart from this checkpoint resumes every slot exactly."""
    by_rank = {rank: (sampler, rng_state) for rank, sampler, rng_state in gathered}
    first = by_rank[min(by_rank)]
    samplers, rngs = [], []
    for slot in range(world_size):
        sampler, rng_state = by_rank.get(slot, first)
        if slot not in by_rank and isinstance(sampler, dict) and "rank" in sampler:
            sampler = {**sampler, "rank": slot}
        samplers.append(sampler)
        rngs.append(rng_state)
    return samplers, rngs


def meta_base(model_args: ModelArgs, cfg_dict: dict[str, Any], schedule: dict[str, Any], tokenizer: str) -> dict[str, Any]:
    return {"model_args": model_args.checkpoint_dict(), "config": cfg_dict, "lr_schedule": schedule,
            "tokenizer": tokenizer}
