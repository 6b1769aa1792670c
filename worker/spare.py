"""A warm spare (`GPUHERD_SPARE=1`, started by the supervisor with --spares): everything a worker
does before it knows its rank, then a wait for one.

The wait ends with one JSON line on stdin, `{"env": {NAME: VALUE, ...}}`: the lost rank's
environment (RANK, its device, its error file, GPUHERD_JOIN_GENERATION: the rebuilt group
to join). It is applied before CUDA is touched, so CUDA_VISIBLE_DEVICES still decides the
GPU. End of input instead: the spare is no longer needed (exit 0, nothing said).

The warm-up runs in a thread of its own at nice WARM_UP_NICE (Linux nice is per thread): a
spare started while the job trains (the pool refilling after a recovery) takes only the CPU
the ranks leave idle; one a shrunk group waits for warms up at the ranks' own priority
(`warm_up_nice`). The process's main thread, the one that trains once promoted, keeps the
priority the supervisor gave it (lowering a nice value back needs CAP_SYS_NICE). Threads the
warm-up starts (torch's intra-op pool) inherit its nice; the main thread's own pool is started
at its first step, at its own priority. Its end is said on the status channel (a
`live`/`warm` record, which the pool reads before the spare holds a rank): a shrunk group
grows back only with a spare that is warm, never waits for one's imports.

With a spare source (`GPUHERD_SPARE_SOURCE_FD`: supervisor/processes/spare_source.py), this
spare is the source: once warm it forks the pool's other spares (worker/spare_fork.py), each as
warm as it is, the rehearsal included, for a few ms of CPU; the rehearsal's thread, and with it
its intra-op pool, has ended by then.

The warm-up ends with a rehearsal of the first training step on the run's own model and
shapes (`rehearse_first_step`), compiled as the run compiles it: what a newcomer would
otherwise pay in its first step after the rebuilt group (the lazy imports, the kernels of
those shapes, the allocator's pool, the compiled graphs) is paid before it is needed.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import orjson

from gpuherd import contract
from worker.heap import freeze_imports

WARM_UP_NICE = 19  # the warm-up yields to every training rank (bench/bench_live_recovery.py: step time at a refill)


REHEARSAL_SHARE = 0.25  # of the available host memory a real-shaped rehearsal may take; past it, a stand-in


def warm_up() -> None:
    """What a replacement would otherwise pay after the failure: the interpreter's imports of
    torch and the trainer, the dataset cache opened (its files mapped, pages cached), and a
    rehearsal of the first training step (`rehearse_first_step`)."""
    import torch  # noqa: F401 - imported for its start-up cost, now rather than after a failure
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import worker.train  # noqa: F401 - the trainer's whole import graph

    vocab = None
    cache = os.environ.get(contract.DATASET_CACHE)
    if cache:
        from dataset_cache import open_data, padded_vocab_size

        try:
            vocab = padded_vocab_size(open_data(Path(cache)).vocab_size)
        except Exception:  # noqa: BLE001 - the rank it replaces will report the cache's problem itself
            pass
    path = os.environ.get(contract.CONFIG_PATH)
    if path:
        try:
            rehearse_first_step(path, vocab)
        except Exception:  # noqa: BLE001 - a warm-up only: the real build reports real problems
            pass


def rehearse_first_step(config_path: str, data_vocab: int | None) -> str:
    """One training step of the run's own model on a dummy batch of its shapes, built as the
    trainer builds it (worker/engines/factory.py, strategy `single`): the lazy imports of the
    meta-device build, the forward, backward and optimizer kernels of those shapes, the
    allocator's pool at the size a step needs, and, where the run compiles its blocks
    (`training.compile`), their compiled graphs: torch.compile's caches live in this process,
    which becomes the rank, so the trainer's compile of the same blocks finds them. CPU runs
    only for the real shapes and the compile: CUDA is not touched before the assignment says
    which GPU, and graphs compiled for the CPU are no GPU's. Where the real shapes would take
    more than REHEARSAL_SHARE of the available memory, or on a GPU run, a one-layer stand-in
    still pays the lazy imports. Returns which it ran (`real` | `stand-in`)."""
    import dataclasses

    import psutil
    import torch

    from gpuherd.config import Config
    from gpuherd.memory_plan import Layout
    from gpuherd.model_size import count_params
    from gpuherd import rng
    from worker.attention import resolve_backend
    from worker.engines import Precision, build_engine
    from worker.model import ModelArgs

    cfg = Config.load(Path(config_path))
    cpu = torch.device("cpu")
    vocab = cfg.model.vocab_size or data_vocab or 256
    t = cfg.training
    batch = (t.batch_size, cfg.data.context_length)
    # weights, gradients, two AdamW moments, and one micro-batch's activations and logits (generously)
    tokens = batch[0] * batch[1]
    need = 16 * count_params(cfg.model, vocab) + 64 * tokens * cfg.model.dim * cfg.model.n_layers + 12 * tokens * vocab
    real = cfg.system.device == "cpu" and need <= REHEARSAL_SHARE * psutil.virtual_memory().available
    if not real:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=1, dim=cfg.model.n_heads * 8),
                                  training=dataclasses.replace(t, compile=False))
        vocab, batch = 64, (1, 16)
    args = ModelArgs.from_config(cfg.model, vocab, batch[1])
    attention, _ = resolve_backend(cfg.model.attention, cpu, Precision.choose(cfg, cpu).autocast_dtype)
    engine = build_engine(cfg, args, Layout("single", t.gradient_checkpointing), cpu, attention, world_size=1)
    tokens = torch.zeros(batch, dtype=torch.int64)
    engine.micro_step(tokens, tokens, is_last=True)
    engine.step(t.learning_rate, t.max_grad_norm, None)
    rng.seed_everything(cfg.system.seed)  # leaves no trace: the trainer seeds everything itself anyway
    return "real" if real else "stand-in"


def warm_up_nice() -> int:
    """The warm-up thread's nice value: WARM_UP_NICE, or what the supervisor set where a shrunk
    group waits for this spare (`contract.SPARE_WARM_UP_NICE`, "0"): at nice 19 beside ranks that
    keep every core busy the warm-up gets about 1% of a core and the group could stay shrunk for
    the rest of the run, each second of it a rank's share of the job's steps lost."""
    said = os.environ.get(contract.SPARE_WARM_UP_NICE, "")
    return int(said) if said.isdigit() and int(said) <= WARM_UP_NICE else WARM_UP_NICE


def _warm_up_yielding(assigned: threading.Event, done_fd: int = -1) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), warm_up_nice())  # this thread only
    except OSError:  # not permitted here: warm up at the process's priority
        pass
    try:
        warm_up()
        freeze_imports()
        fd = os.environ.get(contract.STATUS_FD)
        if fd and not assigned.is_set():  # the pool may now hand it a carried rank (a regrow) without a wait
            from gpuherd.status_channel import StatusWriter

            StatusWriter(int(fd), 0).send("live", event="warm")
    finally:
        if done_fd >= 0:  # a spare source forks spares from now on (worker/spare_fork.py)
            try:
                os.write(done_fd, b"w")
            except OSError:  # it took a rank before: nobody reads this any more
                pass
            os.close(done_fd)


def stand_by() -> bool:
    """Warm up (a low-priority thread), then wait for a rank; True once this process took one
    (os.environ updated). A rank assigned before the warm-up ended waits for its end: the CPU
    it needed is then idle anyway (the survivors wait for the newcomer)."""
    assigned = threading.Event()
    source = os.environ.pop(contract.SPARE_SOURCE_FD, None)  # a spare source's forks are no sources
    wake_r, wake_w = os.pipe() if source is not None else (-1, -1)
    warming = threading.Thread(target=_warm_up_yielding, args=(assigned, wake_w), name="spare-warm-up", daemon=True)
    warming.start()
    if source is not None:
        from worker.spare_fork import serve

        serve(int(source), wake_r, warming)  # returns in the source and in each spare it forks
    line = sys.stdin.buffer.readline()
    assigned.set()
    if not line.strip():
        return False
    warming.join()
    assignment = orjson.loads(line)
    os.environ.update({str(name): str(value) for name, value in assignment["env"].items()})
    os.environ.pop(contract.SPARE, None)
    return True
