"""PyTorch Lightning: `Trainer(callbacks=[GpuherdCallback()])` tells gpuherd Lightning's global
step and the path and step of every checkpoint the Trainer writes (ModelCheckpoint's, a
`trainer.save_checkpoint(...)`), which the script bootstrap alone cannot see: Lightning writes
its checkpoint through an in-memory buffer. Rank 0 reports the saves (it writes them); every rank
its steps. Outside gpuherd it does nothing.
"""

from __future__ import annotations

import os
from typing import Any

from gpuherd.integrations.report import FrameworkReport

try:  # the `lightning` package, else the standalone `pytorch_lightning`: either Trainer takes it in its list
    from lightning.pytorch import Callback
except ImportError:
    from pytorch_lightning import Callback


class GpuherdCallback(Callback):
    def __init__(self) -> None:
        self.report = FrameworkReport("lightning")
        self._wrapped: Any = None  # the trainer whose save_checkpoint reports

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not self.report.active or self._wrapped is trainer:
            return
        self.report.take_over()
        save = trainer.save_checkpoint
        report = self.report

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> None:
            told = trainer.is_global_zero
            if told:
                report.save_began()
            path = None
            try:
                save(filepath, *args, **kwargs)
                path = os.fspath(filepath)
            finally:
                if told:
                    report.save_ended(trainer.global_step, path)

        trainer.save_checkpoint = save_checkpoint  # every save of the Trainer goes through it (ModelCheckpoint's too)
        self._wrapped = trainer

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._wrapped is trainer:
            del trainer.save_checkpoint  # the Trainer's own method again
            self._wrapped = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.report.active:
            self.report.step(trainer.global_step)
