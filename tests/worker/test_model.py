"""The Llama-style model: names, init, attention backends, checkpointing, KV cache."""

from __future__ import annotations

import pytest
import torch

from gpuherd.config import ConfigError, ModelConfig
from worker.attention import eager_attention, flash_attn_installed, get_attention, resolve_backend, sdpa_attention
from worker.model import KVCache, ModelArgs, Transformer


def make(tie: bool = False, layers: int = 2, backend: str = "sdpa", seed: int = 0) -> Transformer:
    cfg = ModelConfig(n_layers=layers, dim=64, n_heads=4, n_kv_heads=2, multiple_of=32, tie_embeddings=tie)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg, vocab_size=128, max_seq_len=32))
    model.to_empty(device="cpu")
    model.init_weights(seed, torch.device("cpu"))
    model.set_attention_backend(backend)
    return model


def test_parameter_names_follow_the_seed_report():
    names = {n for n, _ in make().named_parameters()}
    for expected in ("tok_embed.weight", "layers.0.attention.wq.weight", "layers.1.attention.wo.weight",
                     "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
                     "layers.0.feed_forward.w3.weight", "layers.0.attention_norm.weight",
                     "layers.0.ffn_norm.weight", "norm.weight", "output.weight"):
        assert expected in names
    assert "rope_cos" not in make().state_dict()  # recomputed, never saved


def test_gqa_shapes_and_swiglu_hidden():
    model = make()
    assert model.layers[0].attention.wk.weight.shape == (2 * 16, 64)  # 2 KV heads of dim 16
    assert model.layers[0].feed_forward.w1.weight.shape[0] % 32 == 0


def test_init_is_deterministic_and_scaled():
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    assert torch.all(a.norm.weight == 1)
    assert a.tok_embed.weight.std().item() == pytest.approx(0.02, rel=0.1)
    residual = a.layers[0].attention.wo.weight.std().item()
    assert residual == pytest.approx(0.02 / 2, rel=0.15)  # 1/sqrt(2 * n_layers) with 2 layers


def test_tied_embeddings_share_one_matrix():
    tied = make(tie=True)
    assert tied.output is None
    assert sum(p.numel() for p in tied.parameters()) == tied.num_params()
    assert tied.num_params(matmul_only=True) == tied.num_params()  # the shared matrix is the output head
    untied = make()
    assert untied.num_params(matmul_only=True) == untied.num_params() - 128 * 64
    tokens = torch.randint(0, 128, (2, 8))
    tied(tokens, tokens).backward()
    assert tied.tok_embed.weight.grad is not None


@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("q_len,kv_len", [(12, 12), (1, 12), (5, 12)])
def test_attention_backends_agree(n_kv: int, q_len: int, kv_len: int):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_len, 4, 16, generator=gen)
    k = torch.randn(2, kv_len, n_kv, 16, generator=gen)
    v = torch.randn(2, kv_len, n_kv, 16, generator=gen)
    reference = eager_attention(q, k, v)
    torch.testing.assert_close(sdpa_attention(q, k, v), reference, rtol=1e-5, atol=1e-5)


def test_whole_model_backends_agree():
    tokens = torch.randint(0, 128, (2, 16))
    eager, sdpa = make(backend="eager"), make(backend="sdpa")
    torch.testing.assert_close(sdpa(tokens), eager(tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not flash_attn_installed(), reason="needs CUDA and flash-attn")
def test_flash_attn_agrees_with_eager_on_gpu():
    q = torch.randn(2, 64, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(2, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(get_attention("flash_attn")(q, k, v).float(), eager_attention(q, k, v).float(),
                               rtol=2e-2, atol=2e-2)


def test_backend_choice():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, None) == ("sdpa", "torch scaled_dot_product_attention; not on CUDA")
    assert resolve_backend("eager", cpu, None)[0] == "eager"
    with pytest.raises(ConfigError, match="flash_attn cannot run here: not on CUDA"):
        resolve_backend("flash_attn", cpu, None)
    with pytest.raises(ConfigError, match="unknown attention backend"):
        resolve_backend("fast", cpu, None)


@pytest.fixture
def fake_flash_attn(tmp_path, monkeypatch):
    """A flash_attn package on sys.path whose body the test writes; caches cleared around it."""
    import sys

    from worker import attention

    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    cached = (attention._import_problem, attention._kernel_problem)  # a test may monkeypatch them away
    for fn in cached:
        fn.cache_clear()
    yield pkg / "__init__.py"
    sys.modules.pop("flash_attn", None)
    for fn in cached:
        fn.cache_clear()


def test_flash_attn_that_does_not_load_falls_back_to_sdpa(fake_flash_attn):
    # what a wheel built for another torch does at import
    fake_flash_attn.write_text('raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")\n')
    cuda = torch.device("cuda", 0)
    backend, why = resolve_backend("auto", cuda, torch.bfloat16)
    assert backend == "sdpa" and "installed but does not load (ImportError" in why and "undefined symbol" in why
    with pytest.raises(ConfigError, match="does not load"):
        resolve_backend("flash_attn", cuda, torch.bfloat16)


def test_flash_attn_needs_compute_capability_8(fake_flash_attn, monkeypatch):
    from worker import attention

    fake_flash_attn.write_text("def flash_attn_func(q, k, v, causal):\n    return q\n")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # V100
    backend, why = resolve_backend("auto", torch.device("cuda", 0), torch.bfloat16)
    assert backend == "sdpa" and why.endswith("compute capability 7.0; flash-attn needs 8.0 (Ampere) or newer")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100
    monkeypatch.setattr(attention, "_kernel_problem", lambda index: None)  # the tiny call needs a real GPU
    assert resolve_backend("auto", torch.device("cuda", 0), torch.bfloat16)[0] == "flash_attn"
    assert resolve_backend("auto", torch.device("cuda", 0), None) == (
        "sdpa", "torch scaled_dot_product_attention; not in bf16/fp16")


def test_gradient_checkpointing_gives_the_same_gradients():
    tokens = torch.randint(0, 128, (2, 16))
    plain, ckpt = make(), make()
    ckpt.set_gradient_checkpointing(True)
    plain(tokens, tokens).backward()
    ckpt(tokens, tokens).backward()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_kv_cache_decoding_matches_the_full_forward():
    model = make().eval()
    tokens = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.args, 1, 32, torch.device("cpu"), torch.float32)
        prefill = model(tokens[:, :6], cache=cache)
        steps = [model(tokens[:, i:i + 1], cache=cache) for i in range(6, 10)]
    torch.testing.assert_close(prefill, full[:, :6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 6:], rtol=1e-5, atol=1e-5)
    assert cache.pos == 10


def test_context_overflow_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds the model's context 32"):
        make()(torch.zeros(1, 33, dtype=torch.long))
