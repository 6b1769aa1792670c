"""The configured model against what it will meet: the tokenizer's vocabulary and the memory."""

from __future__ import annotations

from types import SimpleNamespace

import psutil

from gpuherd.config import resolve
from gpuherd.model_size import estimate_bytes
from gpuherd.model_checks import check_fits, check_vocab, host_memory_bytes

GB = 10**9


def test_vocab_below_the_tokenizer_is_named_with_both_numbers():
    cfg = resolve("debug", overrides=["model.vocab_size=10", "data.tokenizer=byte"])
    assert check_vocab(cfg, 256) == ("model.vocab_size=10 is smaller than the vocabulary of tokenizer byte "
                                     "(256 tokens); set it to 0 (the tokenizer's, padded) or at least 256")
    assert check_vocab(resolve("debug", overrides=["model.vocab_size=256"]), 256) is None
    assert check_vocab(resolve("debug"), 50257) is None  # 0: the tokenizer's own


def test_a_small_model_fits_and_the_production_model_does_not_fit_a_24_gb_gpu():
    assert check_fits(resolve("debug"), 1 * GB, tokenizer_vocab=50257) is None
    problem = check_fits(resolve("production"), 24 * GB, tokenizer_vocab=128256, where="GPU 0 (free memory)")
    assert problem.startswith("the model does not fit: training it needs at least ~")
    assert "but GPU 0 (free memory) has 24.0 GB" in problem
    assert "M parameters: ~" in problem and "training.strategy=fsdp" in problem


def test_sharding_over_more_workers_can_make_a_model_fit():
    cfg = resolve("gpt2-small", overrides=["training.strategy=fsdp", "training.batch_size=1"])
    single = estimate_bytes(cfg.model, cfg.training, 1, context_length=cfg.data.context_length)
    eight = estimate_bytes(cfg.model, cfg.training, 8, context_length=cfg.data.context_length)
    device = (single.total + eight.total) // 2
    assert check_fits(cfg, device, world_size=1) is not None
    assert check_fits(cfg, device, world_size=8) is None


def test_host_memory_is_what_the_os_can_hand_out_now_shared_between_the_cpu_workers(monkeypatch):
    assert 0 < host_memory_bytes(1) <= psutil.virtual_memory().total
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=8 * GB, total=16 * GB))
    assert host_memory_bytes(4) == 2 * GB and host_memory_bytes(0) == 8 * GB
