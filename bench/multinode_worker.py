"""A torchrun-style worker for bench_multinode.py: one gloo process group across two
"nodes"; rank 1 dies (exit 1) after a second and records when and on which node.

Mode `collective`: both ranks all-reduce in a loop, so the survivor's next collective
fails at once on the dead peer (gloo's best case). Mode `blocked`: the survivor is in
a long operation and never touches the peer (a GPU kernel, a data-loader stall, or an
NCCL collective waiting for its watchdog), so only the launcher can tell it.

    python multinode_worker.py OUT_DIR collective|blocked
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out, mode = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
start = time.monotonic()
while True:
    if rank == 1 and time.monotonic() - start > 1.0:
        (out / "died").write_text(f"{time.time()!r} {os.environ['GROUP_RANK']}")
        os._exit(1)
    if mode == "collective":
        dist.all_reduce(t)
    time.sleep(0.05)
