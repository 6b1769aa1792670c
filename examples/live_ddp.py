"""A plain DDP training loop, nanoGPT-style, with gpuherd's live recovery: three lines differ from
the loop without it (the import, `live.attach`, the `for` line). Under `gpuherd run` a lost rank
is replaced by a warm spare while the other ranks keep their processes, and the loop goes on at
the step it was in; anywhere else (plain torchrun) gpuherd.live does nothing.

    torchrun --nproc-per-node 4 examples/live_ddp.py --steps 60
    gpuherd run --nproc-per-node 4 --max-restarts 2 examples/live_ddp.py --steps 60

Synthetic data from one seeded generator: every rank draws the global batch and trains on its
own slice, so every rank's data position is the same (a newcomer takes a survivor's). gloo on
CPU, NCCL on GPUs. Rank 0 prints `step N loss L` for every step.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gpuherd.live as live  # a no-op outside gpuherd


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim),
                          nn.GELU(), nn.Linear(args.dim, args.dim)).to(device)
    model = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(args.seed)  # one global draw per step, each rank its slice

    session = live.attach(model, optimizer, position={"data": data})
    for step in session.steps(range(args.steps)):
        batch = torch.randn(world * args.batch, args.dim, generator=data)
        x = batch[rank * args.batch:(rank + 1) * args.batch].to(device)
        loss = nn.functional.mse_loss(model(x), x.roll(1, dims=1))  # learn to rotate the features
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
