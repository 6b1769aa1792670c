"""Two gloo ranks under DDP with policy rerun, run as a script (one process per rank):

    python tests/worker/nan/rerun_ranks.py STORE OUT_DIR

Trains TinyLM for 4 steps twice in the same process group: once with rank 1's
gradient corrupted (NaN) on step 1 only, once clean. Writes what it saw to
OUT_DIR/rank{r}.json and its status records to OUT_DIR/status{r}.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

from tests.worker.nan.helpers import TinyLM, clean_batch, param_checksum  # noqa: E402
from tests.worker.nan.replay_helpers import GradientFault, replayable_step, suspicious_config  # noqa: E402

STEPS, FAULT_STEP = 4, 1


def train(identity, out_dir: Path, faulty: bool) -> list[str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpuherd.status_channel import StatusWriter
    from worker.nan import NanGuard

    torch.manual_seed(0)
    model = TinyLM()
    # Registered before the guard's probes: they see the corrupted local gradient, as
    # they would see a flaky device's, before DDP's all-reduce spreads it to rank 0.
    fault = GradientFault(model.layers[1].feed_forward.w1.weight) if faulty and identity.rank == 1 else None
    ddp = DDP(model)
    fd = os.open(out_dir / f"status{identity.rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    cfg = suspicious_config(out_dir / ("ckpt" if faulty else "ckpt-clean"), nan_policy="rerun", hooks=True)
    guard = NanGuard(cfg, ddp, identity, StatusWriter(fd if faulty else None, identity.rank), None)
    guard.attach()
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sums = []
    for step in range(STEPS):
        if fault is not None:
            fault.armed = step == FAULT_STEP
        batches = [clean_batch(10 * step + identity.rank), clean_batch(10 * step + identity.rank + 5)]
        assert replayable_step(ddp, opt, guard, step, batches, lr=1e-2)
        sums.append(param_checksum(model))
    guard.detach()
    os.close(fd)
    return sums


def main(store: str, out_dir: Path) -> int:
    import torch.distributed as dist
    from loguru import logger

    from gpuherd.contract import WorkerIdentity

    torch.set_num_threads(1)
    logger.remove()
    logger.add(sys.stderr, format="{level} | {message}", level="DEBUG")
    identity = WorkerIdentity.from_env()
    dist.init_process_group("gloo", init_method=store, rank=identity.rank, world_size=identity.world_size)
    try:
        result = {"faulty": train(identity, out_dir, faulty=True), "clean": train(identity, out_dir, faulty=False)}
        (out_dir / f"rank{identity.rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
