"""The memory estimate and the layout it chooses: the production preset fits the machine
it starts on, or says in one line that it cannot."""

from __future__ import annotations

import pytest
import torch

from gpuherd.config import ModelConfig, preset
from gpuherd.memory_plan import GIB, Layout, ModelShape, Workload, candidate_layouts, choose_layout, estimate_bytes
from worker.model import ModelArgs, Transformer

H100 = int(79.1 * GIB)  # what torch.cuda.get_device_properties reports for an 80 GB H100


@pytest.mark.parametrize("model", [
    ModelConfig(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, multiple_of=32),
    ModelConfig(n_layers=3, dim=96, n_heads=6, n_kv_heads=None, multiple_of=64, ffn_dim_multiplier=1.3,
                tie_embeddings=True),
])
def test_parameter_count_is_the_models(model: ModelConfig):
    with torch.device("meta"):
        real = Transformer(ModelArgs.from_config(model, vocab_size=1000, max_seq_len=16))
    assert ModelShape.of(model, 1000).params == real.num_params()


def production(world: int, **training):
    cfg = preset("production")
    shape = ModelShape.of(cfg.model, 50304)
    t = cfg.training
    work = Workload(world, training.get("batch_size", t.batch_size), cfg.data.context_length,
                    training.get("grad_accum", t.grad_accum_nums))
    return shape, work


def test_production_on_one_h100_does_not_fit_and_says_so():
    shape, work = production(1)
    assert shape.params == pytest.approx(6.08e9, rel=0.01)
    choice = choose_layout(shape, work, H100)
    # 16 B/param of AdamW state alone is ~97 GB: no layout of one GPU fits
    assert not choice.fits and choice.chosen and choice.layout == Layout("single", checkpointing=True)


@pytest.mark.parametrize("world, expected", [
    (2, Layout("fsdp", checkpointing=True, reduce_every_micro_batch=True)),
    (4, Layout("fsdp", reduce_every_micro_batch=True)),
    (8, Layout("fsdp", reduce_every_micro_batch=True)),
])
def test_production_on_several_h100s_shards_with_per_micro_batch_reduce_scatter(world: int, expected: Layout):
    shape, work = production(world)
    choice = choose_layout(shape, work, H100)
    assert choice.fits and choice.layout == expected
    # DDP would need the whole AdamW state on every GPU; FSDP accumulating unsharded
    # fp32 gradients across 8 micro-batches would need 4 B/param more on every GPU
    assert estimate_bytes(shape, Layout("ddp"), work).total > H100
    assert estimate_bytes(shape, Layout("fsdp"), work).total > H100
    assert choice.note().startswith("chosen by memory estimate: ~") and choice.note().endswith("of 79.1 GiB per GPU")


def test_small_models_keep_the_fast_layout():
    cfg = preset("gpt2-small")
    shape = ModelShape.of(cfg.model, 50304)
    work = Workload(1, cfg.training.batch_size, cfg.data.context_length, cfg.training.grad_accum_nums)
    assert choose_layout(shape, work, H100).layout == Layout("single")
    assert choose_layout(shape, Workload(8, 16, 1024, 4), H100).layout == Layout("ddp")
    assert choose_layout(shape, work, 8 * GIB).layout == Layout("single", checkpointing=True)


def test_what_the_user_chose_is_kept():
    shape, work = production(8)
    # checkpointing asked for is never dropped; an explicit fsdp only gets its reduce cadence chosen
    assert choose_layout(shape, work, H100, checkpointing=True).layout == Layout("fsdp", checkpointing=True)
    assert choose_layout(shape, work, H100, "fsdp").layout == Layout("fsdp", reduce_every_micro_batch=True)
    ddp = choose_layout(shape, work, H100, "ddp")
    assert ddp.layout == Layout("ddp") and not ddp.fits and not ddp.chosen
    assert choose_layout(shape, work, H100, "zero1") is None and choose_layout(shape, work, H100, "deepspeed") is None


def test_the_ladder_goes_from_fastest_to_leanest():
    assert candidate_layouts(1, 8) == [Layout("single"), Layout("single", True)]
    assert candidate_layouts(4, 1) == [Layout("ddp"), Layout("fsdp"), Layout("fsdp", True)]
    shape, work = production(4)
    totals = [estimate_bytes(shape, lay, work).total for lay in candidate_layouts(4, 8)[1:]]
    assert totals == sorted(totals, reverse=True)


def test_live_recovery_of_fsdp_costs_four_shard_copies_of_host_ram_checked_at_launch_with_the_processes():
    from gpuherd.memory_plan import shard_copy_bytes
    from gpuherd.model_checks import check_processes_fit

    # two own snapshots and two of the neighbour's, each 12 B/param (fp32 weights, AdamW's two moments)
    assert shard_copy_bytes(1_000_000, 4) == 4 * 12 * 250_000
    assert shard_copy_bytes(10, 3) == 4 * 12 * 4  # the largest (first) shard of an uneven split
    assert check_processes_fit(2, 1, 0, 10 * GIB, copy_bytes=GIB) is None
    refused = check_processes_fit(2, 1, 0, 2 * GIB, copy_bytes=GIB)
    assert refused is not None and "1.1 GB of shard copies (system.shard_copies)" in refused
    assert check_processes_fit(2, 1, 0, 2 * GIB) is None  # without the copies the same processes fit
