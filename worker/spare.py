"""A warm spare (`GPUHERD_SPARE=1`, started by the supervisor with --spares): everything a worker
does before it knows its rank, then a wait for one.

The wait ends with one JSON line on stdin, `{"env": {NAME: VALUE, ...}}`: the lost rank's
environment (RANK, its device, its error file, GPUHERD_JOIN_GENERATION: the rebuilt group
to join). It is applied before CUDA is touched, so CUDA_VISIBLE_DEVICES still decides the
GPU. End of input instead: the spare is no longer needed (exit 0, nothing said).

The warm-up runs in a thread of its own at nice WARM_UP_NICE (Linux nice is per thread): a
spare started while the job trains (the pool refilling after a recovery) takes only the CPU
the ranks leave idle, and the process's main thread, the one that trains once promoted, keeps
the priority the supervisor gave it (lowering a nice value back needs CAP_SYS_NICE). Threads
the warm-up starts (torch's intra-op pool) inherit its nice; the main thread's own pool is
started at its first step, at its own priority.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import orjson

from gpuherd import contract

WARM_UP_NICE = 19  # the warm-up yields to every training rank (bench/bench_live_recovery.py: step time at a refill)


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


def _warm_up_yielding() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_UP_NICE)  # this thread only
    except OSError:  # not permitted here: warm up at the process's priority
        pass
    warm_up()


def stand_by() -> bool:
    """Warm up (a low-priority thread), then wait for a rank; True once this process took one
    (os.environ updated). A rank assigned before the warm-up ended waits for its end: the CPU
    it needed is then idle anyway (the survivors wait for the newcomer)."""
    warming = threading.Thread(target=_warm_up_yielding, name="spare-warm-up", daemon=True)
    warming.start()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return False
    warming.join()
    assignment = orjson.loads(line)
    os.environ.update({str(name): str(value) for name, value in assignment["env"].items()})
    os.environ.pop(contract.SPARE, None)
    return True
