"""A Lightning script that saves with its own ModelCheckpoint every 10 steps and resumes with
`ckpt_path="last"`; rank 0 prints `step N loss X`.

--callback: gpuherd's Lightning callback in the Trainer's list (gpuherd.integrations.lightning).
--kill-at N: in the first attempt rank 1 SIGKILLs itself after step N, and from step N-5 on
each step sleeps 0.3 s (so the steps after the last save take a measurable time).
"""

import argparse
import os
import signal
import time

import pytorch_lightning as pl
import torch
from lightning_train import Regression  # beside this script: its directory is sys.path[0], as under python
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class Killed(Regression):
    """lightning_train.py's model, whose rank 1 dies at step `kill_at` of the first attempt."""

    def __init__(self, kill_at: int | None) -> None:
        super().__init__()
        self.kill_at = kill_at if FIRST_ATTEMPT else None

    def training_step(self, batch, batch_idx):
        if self.kill_at is not None and self.global_step >= self.kill_at - 5:
            time.sleep(0.3)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.kill_at is not None and self.global_rank == 1 and self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--callback", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(1337, verbose=False)
    x = torch.randn(320, 16, generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    callbacks = [ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=10, save_last=True)]
    if args.callback:
        from gpuherd.integrations.lightning import GpuherdCallback
        callbacks.append(GpuherdCallback())
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, logger=False,
                         callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Killed(args.kill_at), loader, ckpt_path="last")


if __name__ == "__main__":
    main()
