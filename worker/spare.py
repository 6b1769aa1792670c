"""A warm spare (`GPUHERD_SPARE=1`, started by the supervisor with --spares): everything a worker
does before it knows its rank, then a wait for one.

The wait ends with one JSON line on stdin, `{"env": {NAME: VALUE, ...}}`: the lost rank's
environment (RANK, its device, its error file, GPUHERD_JOIN_GENERATION: the rebuilt group
to join). It is applied before CUDA is touched, so CUDA_VISIBLE_DEVICES still decides the
GPU. End of input instead: the spare is no longer needed (exit 0, nothing said).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import orjson

from gpuherd import contract


def warm_up() -> None:
    """What a replacement would otherwise pay after the failure: the interpreter's imports of
    torch and the trainer, torch's lazy imports on the way through one training step, and the
    dataset cache opened (its files mapped, pages cached)."""
    import torch  # noqa: F401 - imported for its start-up cost, now rather than after a failure
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import worker.train  # noqa: F401 - the trainer's whole import graph

    path = os.environ.get(contract.CONFIG_PATH)
    if path:
        try:
            _one_tiny_step(path)
        except Exception:  # noqa: BLE001 - a warm-up only: the real build reports real problems
            pass
    cache = os.environ.get(contract.DATASET_CACHE)
    if cache:
        from dataset_cache import open_data

        try:
            open_data(Path(cache))
        except Exception:  # noqa: BLE001 - the rank it replaces will report the cache's problem itself
            pass


def _one_tiny_step(config_path: str) -> None:
    """One CPU training step of a one-layer model shaped like the run's: the first model built on
    the meta device imports torch._dynamo & co. lazily (13 s on a loaded 2-core machine), and the
    first backward and optimizer step their own. CPU only: CUDA is not touched before the
    assignment says which GPU."""
    import dataclasses

    import torch

    from gpuherd.config import Config
    from worker.model import ModelArgs, Transformer

    cfg = Config.load(Path(config_path))
    shape = dataclasses.replace(cfg.model, n_layers=1, dim=cfg.model.n_heads * 8)
    args = ModelArgs.from_config(shape, 64, 16)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights(cfg.system.seed, torch.device("cpu"))
    tokens = torch.zeros((1, 16), dtype=torch.int64)
    model(tokens, tokens).backward()
    torch.optim.AdamW(model.parameters()).step()
    torch.manual_seed(cfg.system.seed)  # leaves no trace: the trainer seeds everything itself anyway


def stand_by() -> bool:
    """Warm up, then wait for a rank; True once this process took one (os.environ updated)."""
    warm_up()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return False
    assignment = orjson.loads(line)
    os.environ.update({str(name): str(value) for name, value in assignment["env"].items()})
    os.environ.pop(contract.SPARE, None)
    return True
