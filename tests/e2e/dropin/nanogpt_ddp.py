"""A nanoGPT-style training script, launched by torchrun or `gpuherd run` (never edited for either).

Distributed setup as karpathy/nanoGPT's train.py does it: DDP when RANK is in the
environment, `init_process_group()` with no arguments (env://, the default backend:
gloo on CPU). Rank 0 prints `step N loss X` for the test to compare launchers.

    python nanogpt_ddp.py [STEPS] [--sleep S] [--save-slowly S]

--sleep: seconds per step (a test stops one rank mid-run); --save-slowly: at the end rank 0
torch.saves an object whose pickling takes S seconds while the other rank exits at once.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


class SlowToPickle:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)  # a big checkpoint, as far as the launcher can tell
        return (SlowToPickle, (0.0,))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int, nargs="?", default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--save-slowly", type=float, default=0.0)
    args = parser.parse_args()
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank = 0
    if ddp:
        dist.init_process_group()
        rank = int(os.environ["RANK"])
    torch.manual_seed(1337)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    if ddp:
        model = DDP(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data)
        loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.8f}", flush=True)
        time.sleep(args.sleep)
    if args.save_slowly and rank == 0:
        torch.save({"model": model.state_dict(), "extra": SlowToPickle(args.save_slowly)},
                   os.path.join(os.environ.get("CKPT_DIR", "."), "final.pt"))
        print("saved", flush=True)
    if ddp:
        dist.destroy_process_group()  # local: rank 1 leaves at once, while rank 0 may still be saving


if __name__ == "__main__":
    main()
