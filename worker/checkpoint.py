"""Training checkpoints: atomic, last-K, resumable bit for bit.

Layouts under `system.checkpoint_dir`:

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

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from gpuherd.checkpoint_layout import META, checkpoint_name, list_checkpoints
from gpuherd.exit_codes import ExitCode
from gpuherd.files import atomic_file, fsync_dir
from worker import distributed as wdist
from worker import rng
from worker.distributed import WorkerError
from worker.model import ModelArgs
from worker.parallelize import Engine

FORMAT_FILE = "gpuherd/full-v1"
FORMAT_DCP = "gpuherd/dcp-v1"
FORMAT_DEEPSPEED = "gpuherd/deepspeed-v1"


def atomic_torch_save(obj: Any, path: Path) -> None:
    with atomic_file(path) as handle:
        torch.save(obj, handle)


def load_file(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise WorkerError(f"cannot read checkpoint {path}: {' '.join(str(exc).split())[:200]}", ExitCode.USAGE) from None


def read_meta(path: Path) -> dict[str, Any]:
    """The meta block of any checkpoint layout (used by resume and generate.py)."""
    if path.is_dir():
        if not (path / META).is_file():
            raise WorkerError(f"{path} is not a complete gpuherd checkpoint (no {META})", ExitCode.USAGE)
        return load_file(path / META)
    return load_file(path)["meta"]


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
        if self.engine.strategy == "deepspeed":
            self._save_deepspeed(path, meta)
        elif self.engine.strategy == "fsdp":
            self._save_dcp(path, meta)
        else:
            self._save_file(path, meta)
        wdist.barrier()  # nobody runs ahead (or prunes) before the checkpoint is complete
        if self.rank == 0 and path.parent == self.directory:
            self._prune()
        return path

    def _save_file(self, path: Path, meta: dict[str, Any]) -> None:
        model_sd, optim_sd, optim_format = self._full_states()
        if self.rank == 0:
            atomic_torch_save({"format": FORMAT_FILE, "model": model_sd, "optimizer": optim_sd,
                               "optimizer_format": optim_format, "meta": meta}, path)

    def _full_states(self) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
        engine = self.engine
        model_sd = {k: v.detach().cpu().clone() for k, v in engine.inner.state_dict().items()}
        if engine.strategy == "zero1":
            engine.optimizer.consolidate_state_dict(to=0)  # collective
            optim_sd = engine.optimizer.state_dict() if self.rank == 0 else None
            return model_sd, optim_sd, "zero1"
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim_sd = get_optimizer_state_dict(engine.inner, engine.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return model_sd, optim_sd, "fqn"

    def _save_dcp(self, path: Path, meta: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tmp = path.with_name(path.name + ".tmp")
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        wdist.barrier()
        model_sd, optim_sd = get_state_dict(self.engine.inner, self.engine.optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp)
        self._finish_dir(tmp, path, dict(meta, format=FORMAT_DCP))

    def _save_deepspeed(self, path: Path, meta: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        if self.rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        wdist.barrier()
        self.engine.ds_engine.save_checkpoint(str(tmp), tag="ds", save_latest=False)
        self._finish_dir(tmp, path, dict(meta, format=FORMAT_DEEPSPEED))

    def _finish_dir(self, tmp: Path, path: Path, meta: dict[str, Any]) -> None:
        wdist.barrier()  # every shard is on disk
        if self.rank == 0:
            atomic_torch_save(meta, tmp / META)
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
            fsync_dir(path.parent)

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
        fmt = meta.get("format", FORMAT_FILE) if path.is_dir() else FORMAT_FILE
        if fmt == FORMAT_DEEPSPEED:
            if self.engine.strategy != "deepspeed":
                raise WorkerError(f"{path} is a DeepSpeed checkpoint; resume it with training.strategy=deepspeed",
                                  ExitCode.USAGE)
            self.engine.ds_engine.load_checkpoint(str(path), tag="ds")
        elif self.engine.strategy == "deepspeed":
            raise WorkerError(f"{path} is not a DeepSpeed checkpoint; training.strategy=deepspeed resumes only its own",
                              ExitCode.USAGE)
        elif fmt == FORMAT_DCP:
            self._load_dcp(path)
        else:
            self._load_file(path)
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

    def _load_file(self, path: Path) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_state_dict,
        )

        ckpt = load_file(path)
        engine = self.engine
        options = StateDictOptions(full_state_dict=True)
        saved, wanted = ckpt["optimizer_format"], ("zero1" if engine.strategy == "zero1" else "fqn")
        if saved != wanted:
            # ZeRO-1 keeps optimizer state by parameter index, the others by name
            raise WorkerError(f"{path}: optimizer state saved as '{saved}' cannot be loaded by strategy "
                              f"{engine.strategy}; resume with the strategy that wrote it", ExitCode.USAGE)
        if saved == "zero1":
            set_model_state_dict(engine.inner, ckpt["model"], options=options)
            engine.optimizer.load_state_dict(ckpt["optimizer"])
            return
        set_state_dict(engine.inner, engine.optimizer, model_state_dict=ckpt["model"],
                       optim_state_dict=ckpt["optimizer"], options=options)

    def _load_dcp(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.engine.inner, self.engine.optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.engine.inner, self.engine.optimizer,
                       model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def meta_base(model_args: ModelArgs, cfg_dict: dict[str, Any], schedule: dict[str, Any], tokenizer: str) -> dict[str, Any]:
    return {"model_args": model_args.checkpoint_dict(), "config": cfg_dict, "lr_schedule": schedule,
            "tokenizer": tokenizer}
