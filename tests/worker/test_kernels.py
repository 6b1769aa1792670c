"""The throughput paths equal the reference math: chunked output + cross-entropy,
RoPE without upcast copies, RMSNorm in the input dtype, per-block torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.worker import helpers as h

from gpuherd.config import ModelConfig
from gpuherd.contract import WorkerIdentity
from gpuherd.memory_plan import ce_chunk_tokens
from worker.engines import compile_blocks
from worker.loss import linear_cross_entropy
from worker.model import ModelArgs, RMSNorm, Transformer, apply_rope, rope_tables
from worker.train import run


def reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's own formulation: pairs as complex numbers times e^(i * pos * freq)."""
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
    cis = torch.polar(torch.ones(t, d // 2, dtype=torch.float64), torch.outer(torch.arange(t, dtype=torch.float64), freqs))
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_rope_equals_the_complex_reference(dtype: torch.dtype, tol: float):
    x = torch.randn(2, 300, 4, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, sin = rope_tables(32, 300, 10000.0)
    out = apply_rope(x, cos, sin)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_rope(x, 10000.0), rtol=tol, atol=tol)


def test_rope_in_bf16_rounds_once():
    """bf16 input, fp32 tables: the rotation is exact but for the final rounding, which
    bf16 tables (what FSDP's input casting used to make of them) do not achieve."""
    x = torch.randn(1, 2048, 2, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    cos, sin = rope_tables(64, 2048, 10000.0)
    exact = reference_rope(x, 10000.0)
    ours = (apply_rope(x, cos, sin).double() - exact).abs().max()
    bf16_tables = (apply_rope(x, cos.bfloat16(), sin.bfloat16()).double() - exact).abs().max()
    assert ours < bf16_tables
    assert ours <= exact.abs().max() * 2**-8  # within one bf16 rounding of the largest value


def test_rmsnorm_keeps_the_input_dtype_under_autocast():
    norm = RMSNorm(16, 1e-5)
    norm.weight.data.fill_(1.5)
    x = torch.randn(3, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
    assert out.dtype == torch.bfloat16  # the fp32 weight does not promote the residual stream
    xf = x.float()
    torch.testing.assert_close(out.float(), (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * 1.5),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_equals_full_values_and_grads(chunk: int):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(101, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 101, (64,), generator=gen)
    full = F.cross_entropy(F.linear(hidden, weight), targets)
    full.backward(torch.tensor(2.5, dtype=torch.float64))  # a scaled loss, as with accumulation
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ours = linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    ours.backward(torch.tensor(2.5, dtype=torch.float64))
    torch.testing.assert_close(ours, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hidden.grad, want_h, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight.grad, want_w, rtol=1e-10, atol=1e-12)


def test_chunked_cross_entropy_under_autocast_and_without_grad():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(40, 16, generator=gen).bfloat16()
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, targets, chunk=9)
        full = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, full, rtol=1e-3, atol=1e-3)
    ours.backward()
    assert weight.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all()
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden.float(), weight, targets, chunk=9),
                                   F.cross_entropy(F.linear(hidden.float(), weight), targets), rtol=1e-5, atol=1e-5)


def test_chunk_size_bounds_the_logits_and_the_weight_gradient_traffic():
    assert ce_chunk_tokens(50304, 512) == 256 * 1024**2 // (50304 * 4)  # narrow: the 256 MiB logits bound rules
    assert ce_chunk_tokens(50304, 2048) == 4096  # wider models: at least 2*dim tokens per chunk
    assert ce_chunk_tokens(10**9, 1) == 2


def tiny(layers: int = 2, tie: bool = False) -> Transformer:
    cfg = ModelConfig(n_layers=layers, dim=64, n_heads=4, n_kv_heads=2, multiple_of=32, tie_embeddings=tie)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg, vocab_size=128, max_seq_len=32))
    model.to_empty(device="cpu")
    model.init_weights(0, torch.device("cpu"))
    return model


def test_rope_tables_stay_float32_when_the_module_is_cast():
    """DeepSpeed's module.bfloat16() used to cast the rotary buffers too."""
    model = tiny().bfloat16()
    seen = []
    model.layers[0].register_forward_pre_hook(lambda mod, args: seen.append((args[1].dtype, args[2].dtype)))
    model(torch.randint(0, 128, (1, 16)))
    assert seen == [(torch.float32, torch.float32)]
    assert not list(model.buffers())  # nothing for a cast or a broadcast to touch


def test_residual_stream_is_bf16_under_autocast():
    model = tiny()
    dtypes = []
    for layer in model.layers:
        layer.register_forward_hook(lambda mod, args, out: dtypes.append((args[0].dtype, out.dtype)))
    tokens = torch.randint(0, 128, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(tokens, tokens)
    assert dtypes == [(torch.bfloat16, torch.bfloat16)] * 2 and loss.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow  # inductor's C++ code generation: minutes on a busy 2-core machine
@pytest.mark.integration  # nn.Module.compile (a method, unseen by the collection walk) runs g++ in processes
def test_compiled_blocks_match_eager_on_cpu():
    """The compile path (fullgraph: any graph break fails) for the tiny model."""
    torch._dynamo.reset()
    eager, compiled = tiny(tie=True), tiny(tie=True)
    compile_blocks(compiled, fullgraph=True)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    want = eager(tokens, tokens)
    got = compiled(tokens, tokens)
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.slow  # inductor on CPU, as above
def test_compile_with_nan_hooks_trains(tmp_path):
    """debug.nan_hooks' forward hooks break the graph on purpose: compile without fullgraph."""
    torch._dynamo.reset()
    cfg = h.tiny_config(tmp_path, "training.compile=true", "debug.nan_detection=true", "debug.nan_hooks=true",
                        "training.max_steps=2", "training.warmup_steps=1")
    identity = WorkerIdentity(0, 0, 1, 1, "cpu", 0, False)
    status = tmp_path / "status.jsonl"
    assert run(cfg, identity, data=h.bundle(cfg), status=h.status_writer(status, 0), install_signals=False) == 0
    assert [r["step"] for r in h.read_status(status) if r["type"] == "step" and "loss" in r] == [0, 1]
