"""`transformers.Trainer`: `Trainer(..., callbacks=[GpuherdCallback()])` tells gpuherd the Trainer's
global step and every checkpoint it writes (`<output_dir>/checkpoint-<step>`, at the step it
holds). The world's process 0 reports the saves; every process its steps. Outside gpuherd it
does nothing.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from gpuherd.integrations.report import FrameworkReport


class GpuherdCallback(TrainerCallback):
    def __init__(self) -> None:
        self.report = FrameworkReport("transformers")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.report.take_over()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.report.active:
            return
        self.report.step(state.global_step)
        if control.should_save and state.is_world_process_zero:  # the Trainer saves right after this hook
            self.report.save_began()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.report.active and state.is_world_process_zero:
            path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            self.report.save_ended(state.global_step, path)
