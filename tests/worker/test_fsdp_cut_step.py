"""A step that a lost peer cut short in the middle of FSDP's backward leaves nothing behind: the
step done again after the group is rebuilt has exactly the gradients of a step never cut (FSDP2 on
gloo, one CPU rank, in process; the cut is an error raised from inside the backward, where a
reduce-scatter to a dead peer raises)."""

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
from worker.model import ModelArgs, Transformer

FP32 = Precision(None, False)


@pytest.fixture
def gloo_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine(tmp_path: Path) -> tuple[FSDPEngine, object]:
    cfg = h.tiny_config(tmp_path, "data.context_length=64", "training.grad_accum_nums=1", "model.n_layers=3")
    args = ModelArgs.from_config(cfg.model, h.VOCAB, cfg.data.context_length)
    with torch.device("meta"):
        model = Transformer(args)
    counts = {"n_params": model.num_params(), "n_matmul_params": model.num_params(matmul_only=True)}
    build = Build(cfg, torch.device("cpu"), FP32, 1, Layout("fsdp"))
    FSDPEngine.shard(model, build)
    model.to_empty(device="cpu")
    model.init_weights(cfg.system.seed, torch.device("cpu"))
    return FSDPEngine.create(model, build, counts), h.bundle(cfg).train


def _grads(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {name: p.grad.to_local().clone() for name, p in engine.inner.named_parameters() if p.grad is not None}


class PeerLost(RuntimeError):
    pass


def test_a_backward_cut_short_leaves_no_partial_gradient_for_the_step_done_again(gloo_group, tmp_path: Path):
    clean, batches = _engine(tmp_path)
    inputs, targets = batches.next_batch()
    clean.micro_step(inputs, targets, is_last=True)
    expected = _grads(clean)

    engine, _ = _engine(tmp_path)

    def cut(grad: torch.Tensor) -> torch.Tensor:
        # the output layer's and the final norm's gradients (the root's group, reduced last) are
        # computed by now, the first block's and the embedding's are not
        raise PeerLost("Connection closed by peer")

    handle = engine.inner.layers[1].register_full_backward_pre_hook(lambda module, grad_output: cut(grad_output[0]))
    with pytest.raises(PeerLost):
        engine.micro_step(inputs, targets, is_last=True)
    handle.remove()
    engine.drop_group()
    engine.regroup(None)  # the rebuilt group (here the same one): what every survivor does
    engine.micro_step(inputs, targets, is_last=True)
    got = _grads(engine)

    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), f"{name}: the cut step's partial gradient was added to the step done again"
