"""The torch-free size estimate: parameter counts equal the real model's, and the
memory figures move the way sharding, precision and checkpointing move them."""

from __future__ import annotations

import pytest
import torch

from gpuherd.config import preset, resolve
from gpuherd.model_size import checkpoint_bytes, count_params, estimate_bytes
from worker.model import ModelArgs, Transformer


@pytest.mark.parametrize("overrides, vocab", [
    ([], 50304),  # the debug preset: GQA 4/2
    (["model.tie_embeddings=true", "model.n_kv_heads=null"], 288),
    (["model.ffn_dim_multiplier=1.3", "model.multiple_of=64", "model.dim=192", "model.n_heads=6",
      "model.n_kv_heads=3", "model.n_layers=3"], 1000),
])
def test_parameter_count_equals_the_real_model(overrides, vocab):
    cfg = resolve("debug", overrides=overrides)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg.model, vocab, cfg.data.context_length))
    assert count_params(cfg.model, vocab) == model.num_params()


def test_adamw_training_state_is_16_bytes_a_parameter_and_a_checkpoint_12():
    cfg = preset("production")
    memory = estimate_bytes(cfg.model, cfg.training, 1, context_length=cfg.data.context_length, vocab_size=128256)
    assert memory.params > 6e9  # 32 layers of dim 4096: billions, whatever the vocabulary
    assert memory.state_bytes == memory.params * 16  # fp32 weights, gradients, two AdamW moments
    assert checkpoint_bytes(memory.params) == memory.params * 12  # weights + moments
    assert memory.total == memory.state_bytes + memory.activation_bytes > 100e9


def test_sharding_precision_and_checkpointing_shrink_the_estimate():
    cfg = preset("gpt2-small")
    base = estimate_bytes(cfg.model, cfg.training, 8)
    cfg.training.strategy = "zero1"
    zero1 = estimate_bytes(cfg.model, cfg.training, 8)
    cfg.training.strategy = "fsdp"
    fsdp = estimate_bytes(cfg.model, cfg.training, 8)
    assert fsdp.state_bytes < zero1.state_bytes < base.state_bytes
    assert fsdp.state_bytes == base.state_bytes // 8
    cfg.training.gradient_checkpointing = True
    assert estimate_bytes(cfg.model, cfg.training, 8).activation_bytes < fsdp.activation_bytes
    cfg.training.use_amp = False
    cfg.training.gradient_checkpointing = False
    assert estimate_bytes(cfg.model, cfg.training, 8).activation_bytes > fsdp.activation_bytes
