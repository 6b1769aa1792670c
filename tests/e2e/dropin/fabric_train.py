"""A Lightning Fabric script as its users write it; launched by torchrun or `gpuherd run`.

Rank 0 prints `step N loss X` and which cluster environment Fabric detected.
"""

import lightning_fabric as lf
import torch
import torch.nn.functional as F


def main() -> None:
    fabric = lf.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    env = fabric.strategy.cluster_environment
    if fabric.global_rank == 0:
        print(f"environment {type(env).__name__} creates_processes_externally={env.creates_processes_externally}",
              flush=True)
    fabric.seed_everything(1337, verbose=False)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.randn(320, 16, generator=torch.Generator().manual_seed(7))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8))
    for step, (xb, yb) in enumerate(loader):
        if step == 12:
            break
        optimizer.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        fabric.backward(loss)
        optimizer.step()
        if fabric.global_rank == 0:
            print(f"step {step} loss {loss.item():.8f}", flush=True)


if __name__ == "__main__":
    main()
