"""Training checkpoints: atomic, last-K, resumable bit for bit.

Layouts under `system.checkpoint_dir` (each engine writes its own, see worker/engines/):

- `step_0000100.pt` (single / ddp / zero1): one file written by rank 0
  {"format", "model", "optimizer", "optimizer_format", "meta"}.
- `step_0000100/` (fsdp): torch.distributed.checkpoint shards of
  {"model", "optimizer"} plus `meta.pt`.
- `step_0000100/` (deepspeed): DeepSpeed's own files under `ds/` plus `meta.pt`.

`meta` holds step, model args, config, LR schedule, tokenizer, world size and,
per rank, the data-sampler state and every RNG state. Everything is written to
a `.tmp` name, fsynced and renamed, so a crash never leaves a checkpoint that
looks complete; directories count only once `meta.pt` exists. Loads use
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from gpuherd.checkpoint_layout import checkpoint_name, list_checkpoints
from gpuherd.exit_codes import ExitCode
from worker import distributed as wdist
from worker import rng
from worker.checkpoint_io import checkpoint_format, read_meta
from worker.distributed import WorkerError
from worker.engines import Engine
from worker.model import ModelArgs


@dataclass
class Restored:
    step: int
    sampler_state: dict[str, Any] | None


class Checkpointer:
    """Saves and restores the whole training state of one engine (a collective: all ranks call)."""

    def __init__(self, engine: Engine, directory: Path, keep_last: int, rank: int, world_size: int,
                 meta_base: dict[str, Any]) -> None:
        self.engine, self.directory, self.keep_last = engine, directory, keep_last
        self.rank, self.world_size, self.meta_base = rank, world_size, meta_base

    # ------------------------------------------------------------------ save
    def save(self, step: int, sampler_state: dict[str, Any], path: Path | None = None) -> Path:
        """Write the state after `step` optimizer steps to `path` (default: the step's name)."""
        path = path or self.directory / checkpoint_name(step, self.engine.sharded)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(self.meta_base, step=step, world_size=self.world_size, strategy=self.engine.strategy,
                    sampler=wdist.gather_objects(sampler_state),
                    rng=wdist.gather_objects(rng.capture(self.engine.device)))
        self.engine.save_states(path, meta, self.rank)
        wdist.barrier()  # nobody runs ahead (or prunes) before the checkpoint is complete
        if self.rank == 0 and path.parent == self.directory:
            self._prune()
        return path

    def _prune(self) -> None:
        for _, old in list_checkpoints(self.directory)[:-self.keep_last]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path) -> Restored:
        meta = read_meta(path)
        self._check_compatible(path, meta)
        self.engine.load_states(path, checkpoint_format(path, meta))
        sampler = None
        if meta["world_size"] == self.world_size:
            sampler = meta["sampler"][self.rank]
            rng.restore(meta["rng"][self.rank], self.engine.device)
        else:
            logger.warning(f"checkpoint was written by {meta['world_size']} ranks, resuming with {self.world_size}: "
                           "model and optimizer restored, data order and RNG streams start afresh")
        return Restored(step=int(meta["step"]), sampler_state=sampler)

    def _check_compatible(self, path: Path, meta: dict[str, Any]) -> None:
        want, have = self.meta_base["model_args"], meta.get("model_args")
        if have != want:
            diff = sorted(k for k in want if (have or {}).get(k) != want[k])
            raise WorkerError(f"checkpoint {path} holds a different model ({', '.join(diff) or 'unknown layout'} differ); "
                              "use the config it was trained with or start without training.resume", ExitCode.USAGE)


def meta_base(model_args: ModelArgs, cfg_dict: dict[str, Any], schedule: dict[str, Any], tokenizer: str) -> dict[str, Any]:
    return {"model_args": model_args.checkpoint_dict(), "config": cfg_dict, "lr_schedule": schedule,
            "tokenizer": tokenizer}
