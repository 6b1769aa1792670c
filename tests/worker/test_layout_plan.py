"""The worker's layout: chosen by the memory estimate where the config leaves it open,
said in the start-up line, and a model that cannot fit is exit 2 before anything is built.
Also the prefetching batch source the loop reads from (training.num_workers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from loguru import logger
from tests.worker import helpers as h

from gpuherd.config import preset
from gpuherd.contract import WorkerIdentity
from gpuherd.memory_plan import GIB, Layout
from worker import distributed as wdist
from worker.data import ArraySampler, Prefetched
from worker.distributed import WorkerError
from worker.engines import plan_layout
from worker.train import run

H100 = int(79.1 * GIB)
IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cpu",
                          device_id=0, supervised=False)


@pytest.fixture
def log() -> list[str]:
    lines: list[str] = []
    handler = logger.add(lambda m: lines.append(m.record["message"]), level="INFO", format="{message}")
    yield lines
    logger.remove(handler)


def test_production_on_one_gpu_is_exit_2_in_one_line():
    with pytest.raises(WorkerError) as err:
        plan_layout(preset("production"), 50304, 1, H100)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert str(err.value).startswith("the model (6.08B parameters) needs ~")
    assert "more than 1 GPU of 79.1 GiB; use more GPUs, a smaller model (--preset gpt2-small)" in str(err.value)


def test_production_on_eight_gpus_is_sharded_and_said():
    layout, note = plan_layout(preset("production"), 50304, 8, H100)
    assert layout == Layout("fsdp", reduce_every_micro_batch=True)
    assert note.startswith("chosen by memory estimate: ~") and note.endswith(" of 79.1 GiB per GPU")


def test_cpu_and_other_strategies_keep_the_configured_layout(log):
    cfg = preset("production")
    assert plan_layout(cfg, 50304, 2, None) == (Layout("ddp"), None)  # CPU: no estimate
    cfg.training.strategy = "zero1"
    assert plan_layout(cfg, 50304, 8, H100) == (Layout("zero1"), None)
    cfg.training.strategy = "ddp"
    layout, note = plan_layout(cfg, 50304, 8, H100)
    assert layout == Layout("ddp") and note.startswith("as configured: ~")
    assert any("this will probably run out of memory" in line for line in log)  # the user insisted: a warning


def test_run_says_the_chosen_layout_or_refuses(tmp_path: Path, monkeypatch, capfd):
    cfg = h.tiny_config(tmp_path, "training.max_steps=1", "training.warmup_steps=0")
    monkeypatch.setattr(wdist, "smallest_device_memory", lambda device: 100 * GIB)  # as if on a GPU
    assert run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(tmp_path / "s.jsonl", 0),
               install_signals=False) == 0
    start = next(line for line in capfd.readouterr().err.splitlines() if "model:" in line)
    assert "| strategy single x1 (chosen by memory estimate: ~3.3 GiB of 100.0 GiB per GPU) |" in start
    monkeypatch.setattr(wdist, "smallest_device_memory", lambda device: GIB)
    with pytest.raises(WorkerError, match="needs ~3.3 GiB per GPU even as single \\+ activation checkpointing"):
        run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(tmp_path / "s2.jsonl", 0),
            install_signals=False)
    # the refused run saved nothing: only the first run's checkpoint and its manifest are there
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_0000001.pt", "step_0000001.pt.manifest.json"]


def sampler() -> ArraySampler:
    return ArraySampler(np.arange(5000) % 97, batch_size=2, context_length=8, seed=3)


def test_prefetching_hands_out_the_same_batches_and_the_consumed_position():
    plain, ahead = sampler(), Prefetched(sampler(), depth=3, pin=False)
    try:
        for _ in range(4):
            a, b = plain.next_batch(), ahead.next_batch()
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            assert ahead.state_dict() == plain.state_dict()  # not the batches drawn ahead
        with pytest.raises(RuntimeError, match="cannot be rewound"):
            ahead.load_state_dict({"batches_drawn": 0})
    finally:
        ahead.close()
    resumed = Prefetched(sampler(), depth=2, pin=False)
    resumed.load_state_dict(plain.state_dict())
    try:
        assert torch.equal(resumed.next_batch()[0], plain.next_batch()[0])
    finally:
        resumed.close()


def test_a_failing_source_fails_the_loop_not_the_thread():
    class Broken:
        def next_batch(self):
            raise ValueError("cache file vanished")

        def state_dict(self):
            return {}

    source = Prefetched(Broken(), depth=2, pin=False)
    with pytest.raises(ValueError, match="cache file vanished"):
        source.next_batch()
    source.close()
