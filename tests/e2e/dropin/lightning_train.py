"""A PyTorch Lightning script as its users write it; launched by torchrun or `gpuherd run`.

Rank 0 prints `step N loss X` and which cluster environment Lightning detected.
"""

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        if self.global_rank == 0:
            print(f"step {self.global_step} loss {loss.item():.8f}", flush=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    pl.seed_everything(1337, verbose=False)
    x = torch.randn(320, 16, generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    env = trainer.strategy.cluster_environment
    if trainer.global_rank == 0:
        print(f"environment {type(env).__name__} creates_processes_externally={env.creates_processes_externally}",
              flush=True)
    trainer.fit(Regression(), loader)


if __name__ == "__main__":
    main()
