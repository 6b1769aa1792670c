"""gpuherd/model_size.py counts exactly what worker/model.py builds, without torch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpuherd.config import ModelConfig, preset
from gpuherd.model_size import CHECKPOINT_BYTES_PER_PARAM, ModelSize, human_bytes, human_count, parameter_count
from worker.model import ModelArgs, Transformer


def _built(m: ModelConfig, vocab: int) -> int:
    with torch.device("meta"):  # shapes only: a production-sized model costs nothing here
        model = Transformer(ModelArgs.from_config(m, vocab, 128))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("m, vocab", [
    (preset("debug").model, 50304),
    (preset("gpt2-small").model, 50304),  # tied embeddings
    (preset("production").model, 128256),  # grouped-query attention
    (dataclasses.replace(preset("debug").model, ffn_dim_multiplier=1.3, multiple_of=64), 320),
])
def test_parameter_count_matches_the_built_model(m, vocab):
    assert parameter_count(m, vocab) == _built(m, vocab)


def test_checkpoint_bytes_are_weights_and_both_adam_moments():
    size = ModelSize.of(preset("gpt2-small").model, 50304)
    assert size.parameters == 123_587_328
    assert size.checkpoint_bytes == size.parameters * CHECKPOINT_BYTES_PER_PARAM == size.parameters * 12


def test_human_units():
    assert [human_bytes(n) for n in (999, 1000, 1_483_047_936, 73e9, 2e15, 5e18)] == \
        ["999 B", "1.0 KB", "1.5 GB", "73.0 GB", "2.0 PB", "5000.0 PB"]
    assert (human_count(123_587_328), human_count(6_083_055_616)) == ("123.6M", "6.08B")
