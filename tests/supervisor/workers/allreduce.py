"""A minimal torchrun-style script: env:// rendezvous on the supervisor's store, one all_reduce."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item():.0f} port={os.environ['MASTER_PORT']}", flush=True)
dist.barrier()
dist.destroy_process_group()
