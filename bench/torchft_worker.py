"""One replica group of torchft's fault-tolerant DDP, training the built-in trainer's model on
the same data as bench_live_recovery.py's gpuherd runs: the same config (preset + `--set` items),
the same Transformer and initialisation, AdamW over the same parameter groups, the same LR
schedule and clipping, each group reading its own slot of the prepared dataset cache (as rank
`REPLICA_GROUP_ID` of `NUM_REPLICA_GROUPS` DDP ranks would).

torchft's recipe, as its README and train_ddp.py example show: a `Manager` over a
`ProcessGroupGloo`, its `DistributedDataParallel` and `Optimizer` wrappers, one group per
torchrun (which restarts a killed worker), a lighthouse at TORCHFT_LIGHTHOUSE. A restarted
worker heals: it takes the model and optimizer state from a live group, no checkpoint read.
Its data loader starts over (torchft leaves checkpointing it to the user).

    torchrun --standalone --nproc-per-node 1 --max-restarts 1 torchft_worker.py OUT CACHE_DIR PRESET ITEM...

Appends to OUT/group<REPLICA_GROUP_ID>.jsonl one record per line: `ready` (pid, attempt) once,
then one `step` record per step: `start`/`time` (time.time() before zero_grad / after the
optimizer step), `step` (the manager's step it trained), `committed` (the optimizer stepped),
`participants` (replica groups whose gradients were averaged), `participating` (this group's
among them; False while it heals).
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import orjson
import torch
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from gpuherd.config import resolve
from gpuherd import rng
from worker.attention import resolve_backend
from worker.data import cache_bundle
from worker.engines.precision import adamw_kwargs, optimizer_groups
from worker.model import ModelArgs, Transformer
from worker.schedule import WarmupCosine

GROUP = int(os.environ["REPLICA_GROUP_ID"])
GROUPS = int(os.environ["NUM_REPLICA_GROUPS"])
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def main() -> int:
    out, cache, preset, items = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    log = (out / f"group{GROUP}.jsonl").open("ab", buffering=0)

    def record(kind: str, **fields: object) -> None:
        log.write(orjson.dumps({"type": kind, "group": GROUP, "attempt": ATTEMPT, **fields}) + b"\n")

    record("ready", pid=os.getpid(), time=time.time())
    cfg = resolve(preset, overrides=items)
    device, t = torch.device("cpu"), cfg.training
    data = cache_bundle(cache, cfg.model.vocab_size, t.batch_size, cfg.data.context_length, GROUP, GROUPS,
                        cfg.system.seed)
    rng.seed_everything(cfg.system.seed)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg.model, data.vocab_size, cfg.data.context_length))
    model.set_attention_backend(resolve_backend(cfg.model.attention, device, None)[0])
    model.to_empty(device=device)
    model.init_weights(cfg.system.seed, device)
    optim = torch.optim.AdamW(optimizer_groups(model, t.weight_decay), **adamw_kwargs(cfg, device))

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])

    # train_ddp.py's settings: a 5 s gloo timeout, 10 s for the manager's operations
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"bench_{GROUP}",
                      timeout=timedelta(seconds=10))
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optim)
    schedule = WarmupCosine.from_config(t)
    params = [p for p in model.parameters() if p.requires_grad]
    while True:  # until the benchmark ends the run
        started = time.time()
        optimizer.zero_grad()  # starts the quorum for this step
        inputs, targets = data.train.next_batch()
        ddp(inputs, targets).backward()  # the gradients are averaged over the participating groups
        if t.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        step = manager.current_step()  # a healed group's step is its source's now
        for group in optim.param_groups:
            group["lr"] = schedule(step)
        optimizer.step()  # only where every group of the quorum agreed to commit
        record("step", start=started, time=time.time(), step=step, committed=manager.current_step() > step,
               participants=manager.num_participants(), participating=manager.is_participating())


if __name__ == "__main__":
    raise SystemExit(main())
