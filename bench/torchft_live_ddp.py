"""examples/live_ddp.py's loop with torchft's fault tolerance instead of gpuherd.live: the same
model, data (one seeded generator, every group draws the global batch and trains its slice),
optimizer and loss, written as torchft's README and train_ddp.py show: a `Manager` over a
`ProcessGroupGloo`, its `DistributedDataParallel` and `Optimizer` wrappers, one replica group
per `torchrun` (which restarts a killed worker), a lighthouse at TORCHFT_LIGHTHOUSE. The
generator's state is in the manager's state dict, so a restarted group heals to the survivor's
data position as well as its weights (what `position=` is to gpuherd.live).

    REPLICA_GROUP_ID=g NUM_REPLICA_GROUPS=n torchrun --nproc-per-node 1 --max-restarts 1 \
        torchft_live_ddp.py OUT --steps N

Appends to OUT/group<g>.jsonl a `ready` record (pid, attempt), then one `step` record per step
(bench_live_recovery_torchft.py's fields: start, time, step, committed, participants,
participating, and the loss). Lines marked `# bench` are the benchmark's records, not torchft's
recipe: bench_script_live.py leaves them out when it counts the lines that differ from the plain loop.
"""

import argparse
import os
import time  # bench
from datetime import timedelta
from pathlib import Path  # bench

import orjson  # bench
import torch
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)  # bench
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    rank, world = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    device = torch.device("cpu")
    log = (args.out / f"group{rank}.jsonl").open("ab", buffering=0)  # bench

    def record(kind: str, **fields: object) -> None:  # bench
        log.write(orjson.dumps({"type": kind, "group": rank, "attempt": ATTEMPT, **fields}) + b"\n")  # bench

    record("ready", pid=os.getpid(), time=time.time())  # bench
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.GELU(), nn.Linear(4 * args.dim, args.dim),
                          nn.GELU(), nn.Linear(args.dim, args.dim)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(args.seed)  # one global draw per step, each rank its slice

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optimizer.state_dict(), "data": data.get_state()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        data.set_state(state["data"])

    # train_ddp.py's settings: a 5 s gloo timeout, 10 s for the manager's operations
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"live_ddp_{rank}",
                      timeout=timedelta(seconds=10))
    model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optimizer)
    while manager.current_step() < args.steps:
        started = time.time()  # bench
        batch = torch.randn(world * args.batch, args.dim, generator=data)
        x = batch[rank * args.batch:(rank + 1) * args.batch].to(device)
        optimizer.zero_grad()  # starts the quorum for this step (a restarted group heals here)
        loss = nn.functional.mse_loss(model(x), x.roll(1, dims=1))  # learn to rotate the features
        loss.backward()  # averaged over the participating groups
        step = manager.current_step()  # a healed group's step is its source's now
        optimizer.step()  # only where every group of the quorum agreed to commit
        record("step", start=started, time=time.time(), step=step, committed=manager.current_step() > step,  # bench
               participants=manager.num_participants(), participating=manager.is_participating(),  # bench
               loss=loss.item())  # bench


if __name__ == "__main__":
    main()
