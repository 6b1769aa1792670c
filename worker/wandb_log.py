"""Optional Weights & Biases logging, offline only: rank 0 writes a W&B run on disk.

    logging.wandb=offline  ->  <run_dir>/wandb/offline-run-<time>-<run id>-attempt<n>/
                               upload later with `wandb sync <run_dir>/wandb/offline-run-*`
    logging.wandb=off      ->  nothing (the default)

Never contacts a server: the mode is forced to offline here, whatever WANDB_MODE
or a logged-in account says. wandb is an optional dependency; without it the
worker warns once and trains on. The interface matches `worker.reporting.TensorBoard`
(`scalars(step, **values)`, `close()`), so the step reporter feeds both alike.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from loguru import logger

MODES = ("off", "offline")
PROJECT = "gpuherd"
# wandb writes from a service process of its own: a full disk never raises here, its data is
# just lost. Below this much free space the sink reports the disk full itself, so it is dropped
# with one warning and its scalars counted, as TensorBoard's are.
MIN_FREE_BYTES = 1 << 20


class WandbLog:
    name = "W&B offline"

    def __init__(self, mode: str, run_dir: Path | None, rank: int, config: dict[str, Any] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"logging.wandb={mode!r}: expected one of {', '.join(MODES)}")
        self.run: Any = None
        self.where = None if run_dir is None else Path(run_dir) / "wandb"
        if mode == "off" or rank != 0 or run_dir is None:
            return
        try:
            import wandb
        except ImportError:
            logger.warning("logging.wandb=offline but wandb is not installed (pip install wandb): no W&B run")
            return
        run_id = Path(run_dir).name
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        os.environ["WANDB_MODE"] = "offline"  # belt and braces: wandb's own children read it too
        self.run = wandb.init(mode="offline", dir=str(run_dir), project=PROJECT, name=run_id,
                              id=f"{run_id}-attempt{attempt}", config=config or {},
                              settings=wandb.Settings(console="off", silent=True))
        logger.info(f"W&B offline run in {self.run.dir}; upload it later with "
                    f"`wandb sync {Path(run_dir) / 'wandb'}/offline-run-*`")

    def scalars(self, step: int, **values: float | None) -> None:
        if self.run is None:
            return
        if shutil.disk_usage(self.run.dir).free < MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.run.dir)
        present = {name: value for name, value in values.items() if value is not None}
        if present:
            self.run.log(present, step=step)

    def close(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def abandon(self) -> None:
        """Its disk failed: end the W&B run now (marked failed) rather than at interpreter exit,
        whatever wandb still fails to write."""
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception as exc:  # noqa: BLE001 - a failing sink must not end the training
                logger.debug(f"W&B run could not be finished after its disk failed: {exc}")
