"""A minimal torchrun-style script: env:// rendezvous on the supervisor's store, one all_reduce.

    python allreduce.py          one all_reduce, print the sum, exit 0
    python allreduce.py loop     all_reduce forever, a heartbeat after each (ranks talking across
                                 nodes, so a dead peer shows up as "connection closed by peer")
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from gpuherd.status_channel import StatusWriter

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} sum={t.item():.0f} port={os.environ['MASTER_PORT']}", flush=True)
if sys.argv[1:] == ["loop"]:
    status = StatusWriter.from_env(dist.get_rank())
    step = 0
    while True:
        dist.all_reduce(t)
        status.send("step", step=step, max_steps=10**6, loss=1.0)
        step += 1
        time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
