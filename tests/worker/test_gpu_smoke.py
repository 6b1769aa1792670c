"""`pytest -m gpu`: the trainer on a real CUDA GPU, in about a minute.

Each test catches a finding of the CUDA review that only a GPU can show: bf16 runs of
the single and FSDP strategies with `auto` attention doing a real forward, RoPE
staying float32 inside a sharded block, bf16 only where the hardware has it, a peak
FLOP/s entry for this GPU, one host sync per step, no graph breaks in a compiled
block, KV-cache decoding, bit-exact resume, the fused cross-entropy's memory, and the
memory estimate against what the allocator really used. Skipped without a GPU.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tests.worker import helpers as h

from gpuherd.contract import WorkerIdentity
from gpuherd.liveness import Liveness
from gpuherd.memory_plan import Layout, ModelShape, Workload, estimate_bytes
from worker import signals as wsignals
from worker.attention import eager_attention, flash_attention, flash_attn_problem, resolve_backend
from worker.engines import Precision, build_engine, compile_blocks
from worker.loss import linear_cross_entropy
from worker.mfu import peak_flops
from worker.model import KVCache, ModelArgs, Transformer
from worker.train import Trainer, run

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cuda",
                          device_id=0, supervised=False)
# Small but GPU-shaped: head dim 64 (flash kernels), GQA, a few hundred tokens per micro-batch.
SMALL = ["model.n_layers=2", "model.dim=256", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=64",
         "data.context_length=128", "training.use_amp=true", "model.attention=auto"]


def needs_bf16() -> None:
    if torch.cuda.get_device_capability(CUDA)[0] < 8:
        pytest.skip("bf16 needs compute capability 8.0 (this GPU takes the fp16 path)")


def cuda_run(tmp: Path, *extra: str) -> tuple[int, list[dict]]:
    cfg = h.tiny_config(tmp, *SMALL, *extra)
    status = tmp / "status.jsonl"
    code = run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(status, 0), install_signals=False)
    return code, h.read_status(status)


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if r["type"] == "step" and "loss" in r]


def small_model(attention: str = "sdpa", layers: int = 2) -> Transformer:
    cfg = h.tiny_config(Path("."), *SMALL, f"model.n_layers={layers}")
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg.model, h.VOCAB, 128))
    model.to_empty(device=CUDA)
    model.init_weights(0, CUDA)
    model.set_attention_backend(attention)
    return model


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_three_bf16_steps_with_auto_attention(tmp_path: Path, strategy: str, capfd):
    needs_bf16()
    code, records = cuda_run(tmp_path, f"training.strategy={strategy}", "training.max_steps=3",
                             "training.warmup_steps=1")
    assert code == 0
    assert len(losses(records)) == 3 and all(math.isfinite(x) for x in losses(records))
    assert records[0]["type"] == "ready" and records[0]["device"].startswith("cuda")
    start = next(line for line in capfd.readouterr().err.splitlines() if "model:" in line)
    assert f"strategy {strategy} x1" in start and "precision torch.bfloat16" in start
    assert "attention flash_attn" in start or "attention sdpa (torch scaled_dot_product_attention;" in start


def test_rope_stays_float32_inside_a_sharded_block(tmp_path: Path):
    import torch.distributed as dist

    needs_bf16()
    cfg = h.tiny_config(tmp_path, *SMALL, "training.strategy=fsdp")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=CUDA)
    try:
        engine = build_engine(cfg, ModelArgs.from_config(cfg.model, h.VOCAB, 128), Layout("fsdp"), CUDA, "sdpa", 1)
        seen = []
        engine.inner.layers[0].attention.register_forward_pre_hook(
            lambda mod, args: seen.append((args[0].dtype, args[1].dtype, args[2].dtype)))
        tokens = torch.randint(0, h.VOCAB, (2, 128), device=CUDA)
        engine.micro_step(tokens, tokens, is_last=True)
    finally:
        dist.destroy_process_group()
    assert seen == [(torch.bfloat16, torch.float32, torch.float32)]  # bf16 activations, fp32 tables


def test_bf16_only_at_compute_capability_8(tmp_path: Path):
    cfg = h.tiny_config(tmp_path, *SMALL)
    major, _ = torch.cuda.get_device_capability(CUDA)
    expected = Precision(torch.bfloat16, False) if major >= 8 else Precision(torch.float16, True)
    assert Precision.choose(cfg, CUDA) == expected


def test_this_gpu_has_a_peak_flops_entry():
    name = torch.cuda.get_device_name(CUDA)
    assert peak_flops(name) is not None, f"add {name!r} to worker/mfu.py's PEAK_BF16_FLOPS (dense bf16)"


def test_flash_attn_is_used_exactly_where_it_runs():
    problem = flash_attn_problem(CUDA, torch.bfloat16)
    backend, why = resolve_backend("auto", CUDA, torch.bfloat16)
    if problem is not None:
        assert backend == "sdpa" and problem in why
        return
    assert backend == "flash_attn"
    q, k, v = (torch.randn(2, 64, n, 64, device=CUDA, dtype=torch.bfloat16) for n in (8, 2, 2))
    torch.testing.assert_close(flash_attention(q, k, v).float(), eager_attention(q, k, v).float(),
                               rtol=2e-2, atol=2e-2)


def test_one_host_sync_per_logged_step(tmp_path: Path):
    cfg = h.tiny_config(tmp_path, *SMALL, "training.log_every=2", "training.max_steps=6")
    status = h.status_writer(tmp_path / "s", 0)
    trainer = Trainer(cfg, IDENTITY, CUDA, Layout("single"), h.bundle(cfg), status, None, wsignals.SignalState(),
                      Liveness(status))  # not started: its thread would add host reads of its own
    trainer._train_step()  # warm-up: allocator, kernels and the first (logged) step's sync
    syncs = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        for step in range(1, 5):
            trainer.step = step
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer._train_step()
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        trainer.data.train.close()
    # steps 1 and 3 are not logged: no sync at all; 2 and 4 read loss and grad norm once
    assert syncs == [0, 1, 0, 1], syncs


@pytest.mark.integration  # inductor runs nvcc, gcc and ptxas
def test_compiled_blocks_have_no_graph_breaks_and_match_eager():
    from torch._dynamo.utils import counters

    # One compile thread: inductor's default pool of compile workers would outlive the test.
    with torch._inductor.config.patch(compile_threads=1):
        _compiled_blocks_match_eager(counters)


def _compiled_blocks_match_eager(counters) -> None:
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = small_model(), small_model()
    compile_blocks(compiled, fullgraph=False)  # count the breaks instead of failing on the first
    tokens = torch.randint(0, h.VOCAB, (2, 128), device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, got = eager(tokens, tokens), compiled(tokens, tokens)
    got.backward()
    breaks = sum(counters["graph_break"].values())
    assert breaks / len(compiled.layers) == 0, dict(counters["graph_break"])
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_kv_cache_decoding_equals_the_full_forward():
    model = small_model().eval()
    tokens = torch.randint(0, h.VOCAB, (1, 40), device=CUDA)
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.args, 1, 128, CUDA, torch.float32)
        prefill = model(tokens[:, :30], cache=cache)
        steps = [model(tokens[:, i:i + 1], cache=cache) for i in range(30, 40)]
    # fp32 weights, but matmuls may run in TF32 (the trainer enables it): shapes differ, so do roundings
    torch.testing.assert_close(prefill, full[:, :30], rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 30:], rtol=5e-3, atol=5e-3)


def test_checkpoint_resume_is_bit_exact_on_gpu(tmp_path: Path):
    # eager attention: SDPA's fused backward kernels accumulate with atomics (not bit-reproducible)
    common = ("model.attention=eager", "training.max_steps=4", "training.warmup_steps=1", "training.save_every=2")
    code, straight = cuda_run(tmp_path / "a", *common)
    assert code == 0
    ckpt = tmp_path / "a" / "ckpt" / "step_0000002.pt"
    code, resumed = cuda_run(tmp_path / "b", *common, f"training.resume={ckpt}")
    assert code == 0
    assert losses(resumed) == losses(straight)[2:]


def test_fused_cross_entropy_matches_and_never_holds_full_logits():
    vocab, tokens, dim = 50304, 8192, 768
    gen = torch.Generator(device=CUDA).manual_seed(0)
    hidden = torch.randn(tokens, dim, device=CUDA, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, dim, device=CUDA, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=CUDA, generator=gen)
    full_logits = tokens * vocab * 4  # one fp32 copy: 1.6 GB

    def peak(fn) -> tuple[torch.Tensor, int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fn()
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), torch.cuda.max_memory_allocated() - base

    ours, ours_peak = peak(lambda: linear_cross_entropy(hidden, weight, targets))
    hidden.grad = weight.grad = None
    ref, ref_peak = peak(lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets))
    torch.testing.assert_close(ours, ref, rtol=1e-3, atol=1e-3)
    assert ours_peak < full_logits < ref_peak


def test_memory_estimate_bounds_what_the_allocator_used(tmp_path: Path):
    extra = ("model.n_layers=8", "model.dim=1024", "model.n_heads=16", "model.n_kv_heads=4",
             "data.context_length=512", "training.batch_size=8", "training.grad_accum_nums=1")
    torch.cuda.reset_peak_memory_stats()
    code, records = cuda_run(tmp_path, *extra, "training.max_steps=2", "training.warmup_steps=1")
    assert code == 0
    measured = torch.cuda.max_memory_allocated()
    cfg = h.tiny_config(tmp_path, *SMALL, *extra)
    estimate = estimate_bytes(ModelShape.of(cfg.model, h.VOCAB), Layout("single"), Workload(1, 8, 512, 1))
    without_overhead = sum(estimate.parts.values()) - estimate.parts["overhead"]
    assert 0.5 * without_overhead < measured < estimate.total, (measured, estimate.parts)


def test_prefetched_batches_arrive_pinned(tmp_path: Path):
    from worker.data import Prefetched

    cfg = h.tiny_config(tmp_path, *SMALL)
    source = Prefetched(h.bundle(cfg).train, depth=2, pin=True)
    try:
        inputs, targets = source.next_batch()
    finally:
        source.close()
    assert inputs.is_pinned() and targets.is_pinned()
