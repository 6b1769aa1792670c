"""The torchrun-style DDP script of the goodput benchmark, as a user writes it: gloo, a
checkpoint every SAVE_EVERY steps written by rank 0, and on every start a resume from the
newest one. Nothing of gpuherd in it: each launcher runs it unchanged.

    python goodput_worker.py OUT_DIR STEPS STEP_S

Rank 0 appends one line per completed step to OUT_DIR/steps.log, `time pid step seconds`
(seconds: since its previous step or save ended in this process; `-` for a process's first
step, which is warm-up), and `time pid save seconds` per save: the benchmark's own accounting
of what each launcher kept (bench_goodput.py), independent of gpuherd's. Under ft_launcher
it sends NVIDIA's rank-monitor heartbeats too (each step; the timeouts learned in-run after
LEARN_AT steps, as its documentation suggests): without them ft_launcher sees no hang.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ft_heartbeat import ft_client
from torch.nn.parallel import DistributedDataParallel

SAVE_EVERY, LEARN_AT = 20, 30


def newest(ckpt: Path) -> Path | None:
    found = sorted(ckpt.glob("step_*.pt"))
    return found[-1] if found else None


def main() -> int:
    out, steps, step_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    ckpt = out / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)
    ft = ft_client()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    path = newest(ckpt)
    if path is not None:
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    log = (out / "steps.log").open("a") if rank == 0 else None
    last = None
    for step in range(start, steps):
        began = time.time()
        loss = model(torch.randn(32, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(max(0.0, step_s - (time.time() - began)))  # the "compute"
        now = time.time()
        if log is not None:
            log.write(f"{now:.6f} {os.getpid()} {step} {'-' if last is None else f'{now - last:.6f}'}\n")
            log.flush()
        last = now
        if ft is not None:
            ft.send_heartbeat()
            if step == start + LEARN_AT:
                ft.calculate_and_set_hb_timeouts()
        if (step + 1) % SAVE_EVERY == 0 and rank == 0:
            tmp = ckpt / f".step_{step + 1:07d}.tmp"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt / f"step_{step + 1:07d}.pt")
            last = time.time()
            log.write(f"{last:.6f} {os.getpid()} save {last - now:.6f}\n")
            log.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
