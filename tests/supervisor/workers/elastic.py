"""A torchrun-style script for elastic jobs: env:// rendezvous, one all_reduce, then either done
or waiting for more nodes.

    python elastic.py WANT    print this rank's place; exit 0 once the world has WANT ranks, else
                              keep all-reducing (the group alive) until the supervisor restarts it
"""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([1.0])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item():.0f} group {os.environ['GROUP_RANK']}/"
      f"{os.environ['GROUP_WORLD_SIZE']} restart_count {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
if dist.get_world_size() < int(sys.argv[1]):
    while True:  # a membership restart (SIGTERM) ends this
        dist.all_reduce(t)
        time.sleep(0.1)
dist.barrier()
dist.destroy_process_group()
