"""The torchrun-style DDP script of the straggler benchmark: gloo, a CPU-bound step (a small
MLP, one torch thread). Each rank writes its pid to OUT/pid.RANK (so the benchmark can slow one
down from outside); rank 0 appends `time step` per completed step to OUT/steps.log. Under
ft_launcher it sends NVIDIA's rank-monitor heartbeats too. Its loop goes through gpuherd.live
(two lines: `live.attach`, `session.steps`), which does nothing under torchrun and ft_launcher and
under `gpuherd run` lets a warm spare take a rank live (so gpuherd can move its straggler out):
the same script under all three launchers. One seed on every rank (a newcomer takes a survivor's
RNG state, so it must be the same on all).

    python straggler_worker.py OUT_DIR STEPS
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ft_heartbeat import ft_client
from torch.nn.parallel import DistributedDataParallel

import gpuherd.live as live

WIDTH, BATCH, LEARN_AT = 512, 256, 30


def main() -> int:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    ft = ft_client()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (out / f"pid.{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                                        torch.nn.Linear(WIDTH, WIDTH)))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    data = torch.randn(BATCH, WIDTH)
    log = (out / "steps.log").open("a") if rank == 0 else None
    session = live.attach(model, opt)
    for step in session.steps(range(steps)):
        loss = model(data).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log is not None:
            log.write(f"{time.time():.6f} {step + 1}\n")
            log.flush()
        if ft is not None:
            ft.send_heartbeat()
            if step == LEARN_AT:
                ft.calculate_and_set_hb_timeouts()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
