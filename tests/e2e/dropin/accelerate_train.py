"""A HuggingFace accelerate script as its users write it; launched by torchrun or `gpuherd run`.

Rank 0 prints `step N loss X` and the distributed setup accelerate detected.
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator(cpu=True)  # on CPU, as an accelerate user says so
    set_seed(1337)
    x = torch.randn(320, 16, generator=torch.Generator().manual_seed(7))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.is_main_process:
        print(f"setup {accelerator.distributed_type} num_processes={accelerator.num_processes}", flush=True)
    for step, (inputs, targets) in enumerate(loader):
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.is_main_process:
            print(f"step {step} loss {loss.item():.8f}", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
