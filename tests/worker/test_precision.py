"""Mixed precision: bf16 only where the GPU has it natively, and FSDP's bf16 compute
leaving the float32 rotary tables alone (FSDP2 on gloo, one CPU rank, in process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.worker import helpers as h

from gpuherd.memory_plan import Layout
from worker.engines import Precision
from worker.engines.base import Build
from worker.engines.fsdp import FSDPEngine
from worker.engines.torch_engine import SingleEngine
from worker.model import ModelArgs, Transformer

BF16 = Precision(torch.bfloat16, False)


def test_bf16_only_where_the_gpu_has_it_natively(monkeypatch, tmp_path: Path):
    asked = []

    def v100(including_emulation: bool = True) -> bool:  # bf16 by emulation only
        asked.append(including_emulation)
        return including_emulation

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", v100)
    cfg = h.tiny_config(tmp_path, "training.use_amp=true")
    assert Precision.choose(cfg, torch.device("cuda", 0)) == Precision(torch.float16, True)
    assert asked == [False]
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # A100
    assert Precision.choose(cfg, torch.device("cuda", 0)) == BF16
    assert Precision.choose(cfg, torch.device("cpu")) == Precision(None, False)


class OldFSDPEngine(FSDPEngine):
    """FSDP as it was: the default policy casts every floating-point block input to bf16."""

    @classmethod
    def shard(cls, model: Transformer, build: Build) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)


@pytest.fixture
def gloo_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def engine(cls, layout: Layout, tmp_path: Path):
    cfg = h.tiny_config(tmp_path, "data.context_length=128", "training.grad_accum_nums=1")
    args = ModelArgs.from_config(cfg.model, h.VOCAB, cfg.data.context_length)
    with torch.device("meta"):
        model = Transformer(args)
    counts = {"n_params": model.num_params(), "n_matmul_params": model.num_params(matmul_only=True)}
    build = Build(cfg, torch.device("cpu"), BF16, 1, layout)
    cls.shard(model, build)
    model.to_empty(device="cpu")
    model.init_weights(cfg.system.seed, torch.device("cpu"))
    return cls.create(model, build, counts), h.bundle(cfg).train


def train(eng, batches, steps: int = 3) -> tuple[list[float], list[tuple[torch.dtype, torch.dtype]]]:
    rope_dtypes = []
    eng.inner.layers[0].attention.register_forward_pre_hook(
        lambda mod, args: rope_dtypes.append((args[1].dtype, args[2].dtype)))
    losses = []
    for _ in range(steps):
        inputs, targets = batches.next_batch()
        losses.append(float(eng.micro_step(inputs, targets, is_last=True)))
        eng.step(1e-3, 1.0, None)
    return losses, rope_dtypes


def test_fsdp_bf16_keeps_rope_float32_and_follows_the_unsharded_curve(gloo_group, tmp_path: Path):
    reference, _ = train(*engine(SingleEngine, Layout("single"), tmp_path))  # autocast bf16, fp32 tables
    fsdp, fsdp_rope = train(*engine(FSDPEngine, Layout("fsdp"), tmp_path))
    old, old_rope = train(*engine(OldFSDPEngine, Layout("fsdp"), tmp_path))
    assert fsdp_rope == [(torch.float32, torch.float32)] * 3
    assert old_rope == [(torch.bfloat16, torch.bfloat16)] * 3  # what the test would have caught
    # Step 0 runs the same bf16-rounded weights through both: with float32 tables the
    # sharded forward is the unsharded one to the bit; bf16 tables were not.
    assert fsdp[0] == reference[0] and old[0] != reference[0], (reference, fsdp, old)
    # Later steps differ by where gradients are rounded (bf16 parameters under FSDP, fp32
    # masters under autocast), far less than a step's progress.
    assert fsdp == pytest.approx(reference, abs=2e-3)
