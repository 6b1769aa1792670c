"""A DeepSpeed ZeRO-2 script on CPU (gloo) as its users write it; launched by torchrun or `gpuherd run`.

Rank 0 prints `step N loss X` and the ZeRO stage DeepSpeed runs.
"""

import os

import deepspeed
import torch
import torch.nn.functional as F

CONFIG = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
          "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1337)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    rank = int(os.environ["RANK"])
    if rank == 0:
        print(f"zero stage {engine.zero_optimization_stage()}", flush=True)
    x = torch.randn(320, 16, generator=torch.Generator().manual_seed(7))
    y = x.sum(dim=1, keepdim=True)
    for step in range(12):
        lo = (step * 2 + rank) * 8
        loss = F.mse_loss(engine(x[lo:lo + 8]), y[lo:lo + 8])
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.8f}", flush=True)


if __name__ == "__main__":
    main()
