"""NanGuard in one process, with real NaN/Inf values from TinyLM."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from tests.worker.nan.helpers import (
    PAD,
    POISON,
    SEED_SNIPPET,
    LogCapture,
    TinyLM,
    clean_batch,
    make_config,
    make_guard,
    param_checksum,
    train_step,
    with_token,
)

from gpuherd.exit_codes import ExitCode
from worker.nan import NanStop


@pytest.fixture
def log():
    capture = LogCapture()
    yield capture
    capture.close()


@pytest.fixture
def model():
    torch.manual_seed(0)
    return TinyLM()


def test_clean_steps_are_applied_write_nothing_and_hooks_come_off(tmp_path, model, log):
    guard = make_guard(model, make_config(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sums = [param_checksum(model)]
    for step in range(3):
        assert train_step(model, opt, guard, step, [clean_batch(step), clean_batch(step + 10)], lr=0.1) is True
        sums.append(param_checksum(model))
    assert len(set(sums)) == 4  # every step really changed the weights
    assert not tmp_path.exists() or not any(tmp_path.rglob("*"))
    assert log.messages("ERROR") == []
    assert any(m._forward_hooks for m in model.modules())
    guard.detach()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not any(p._backward_hooks for p in model.parameters())


def test_eval_forward_with_nan_does_not_leak_into_the_next_step(tmp_path, model, log):
    guard = make_guard(model, make_config(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.eval()
    with torch.no_grad():
        assert math.isnan(float(model(with_token(clean_batch(0), POISON))))
    model.train()
    assert train_step(model, opt, guard, 0, [clean_batch(1)], lr=0.1) is True
    assert guard._forward.first_bad() is None


def test_inf_parameter_stops_with_seed_banner_checkpoint_pickle_and_status(tmp_path, model, log, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the seed's relative paths: .checkpoints/...
    ckpt_dir = tmp_path / ".checkpoints"
    saved: list[Path] = []

    def save_checkpoint(path: Path) -> None:
        saved.append(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)

    read_fd, write_fd = os.pipe()
    guard = make_guard(model, make_config(ckpt_dir), save_checkpoint, status_fd=write_fd)
    with torch.no_grad():
        model.layers[0].feed_forward.w1.weight[0, 0] = float("inf")
    batch = clean_batch(3)
    with pytest.raises(NanStop) as stop:
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), guard, 0, [batch], lr=0.1)
    assert stop.value.exit_code == ExitCode.NAN == 6
    assert stop.value.ranks == [0]

    lines = log.messages("ERROR")
    start = lines.index("NaN LOSS DETECTED [CPU 0]")
    assert lines[start - 1] == lines[start + 1] == "=" * 80
    assert lines[start + 2: start + 5] == ["Step: 0", "Loss: nan", "Gradient Norm: nan"]
    assert ["", "=" * 40, "PROBLEMATIC TENSORS:", "=" * 40] == lines[start + 6: start + 10]
    assert "⚠️  Gradients with NaN (22 layers):" in lines
    bullet = lines.index("  • layers.0.feed_forward.w1.weight (shape: torch.Size([32, 16]))")
    assert lines[bullet + 1] == "    Grad values: ['NaN', 'NaN', 'NaN', 'NaN', 'NaN', ...]"
    assert lines[bullet + 2] == "    NaN count: 512/512"
    assert "⚠️  Parameters with NaN/Inf values (1 layers):" in lines
    pbullet = lines.index("  • layers.0.feed_forward.w1.weight (shape: torch.Size([32, 16]))", bullet + 1)
    assert lines[pbullet + 1].startswith("    Param values: ['Inf', '")
    assert lines[pbullet + 2: pbullet + 4] == ["    NaN count: 0/512", "    Inf count: 1/512"]
    assert "Total layers with NaN gradients: 22" in lines
    assert "Total layers with NaN/Inf parameters: 1" in lines
    assert any(line.startswith("Affected layers: ['tok_embed.weight', 'magnitude.proj.weight', ") for line in lines)
    assert "First non-finite module (forward): layers.0.feed_forward.w1 (micro-batch 0)" in lines
    assert lines[-3:-1] == ["Checkpoint saved: .checkpoints/nan_grad_step_0.pt",
                            "Debug tensors saved: .checkpoints/debug/nan_debug_step_0.pkl"]
    assert lines[-1] == "[CPU 0] Stopping at step 0 (debug.nan_policy=stop); exit code 6"

    # the checkpoint callback got the seed's path, and what it wrote loads
    assert saved == [ckpt_dir / "nan_grad_step_0.pt"]
    state = torch.load(saved[0], weights_only=True)
    assert math.isinf(float(state["layers.0.feed_forward.w1.weight"][0, 0]))

    data = pickle.loads((ckpt_dir / "debug" / "nan_debug_step_0.pkl").read_bytes())
    assert set(data["parameters"]) == {n for n, _ in model.named_parameters()} == set(data["gradients"])
    assert all(a.dtype == np.float32 for a in data["parameters"].values())
    assert np.isinf(data["parameters"]["layers.0.feed_forward.w1.weight"][0, 0])
    assert all(np.isnan(g).all() for g in data["gradients"].values())
    assert (data["step"], data["rank"], data["device"], data["lr"]) == (0, 0, "cpu", 0.1)
    assert math.isnan(data["loss"]) and math.isnan(data["grad_norm"])
    assert np.array_equal(data["batch_token_ids"][0], batch.numpy())
    assert data["first_bad_module"]["module"] == "layers.0.feed_forward.w1"
    assert data["first_bad_module"]["input"]["nan"] == 0  # its input was still finite
    assert data["affected_layers"][:2] == ["tok_embed.weight", "magnitude.proj.weight"]
    assert data["host"] and data["policy"] == "stop" and data["action"] == "stop"

    # the seed's analysis snippet, verbatim, on the file
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(SEED_SNIPPET, "seed003_snippet", "exec"), {})
    expected = [f"{n}: 100.0% NaN" for n in data["gradients"]]
    assert out.getvalue().splitlines() == expected  # the Inf weight is not NaN: no "has NaN values" line

    os.close(write_fd)
    records = [orjson.loads(r) for r in os.read(read_fd, 65536).splitlines()]
    os.close(read_fd)
    assert [r["type"] for r in records] == ["nan"]
    assert records[0]["step"] == 0 and records[0]["ranks"] == [0] and records[0]["action"] == "stop"
    assert records[0]["report"].endswith("debug/nan_debug_step_0.pkl")


def test_backward_only_nan_skip_policy_skips_counts_and_then_stops(tmp_path, model, log):
    saved: list[Path] = []
    guard = make_guard(model, make_config(tmp_path, policy="skip", max_skips=2), saved.append)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = param_checksum(model)

    # step 0: a PAD token -> sqrt(0) in backward: finite loss, NaN gradients
    assert train_step(model, opt, guard, 0, [with_token(clean_batch(0), PAD)], lr=0.1) is False
    assert param_checksum(model) == before  # skipped: the weights did not move
    lines = log.messages("ERROR")
    assert "NaN GRADIENT DETECTED [CPU 0]" in lines
    loss_line = next(line for line in lines if line.startswith("Loss: "))
    assert math.isfinite(float(loss_line.split(": ")[1]))
    assert any(line.startswith("First non-finite local gradient (backward, before clipping and all-reduce):"
                               " magnitude.proj.weight (micro-batch 0; 1 non-finite") for line in lines)
    assert "Forward outputs and local gradients on this rank stayed finite" not in lines
    assert not any(line.startswith("First non-finite module") for line in lines)  # forward stayed finite
    assert not any(line.startswith("Checkpoint saved") for line in lines)  # skipping: no checkpoint
    assert "Debug tensors saved: " + str(tmp_path / "debug" / "nan_debug_step_0.pkl") in lines
    assert any("step 0 not applied (1/2 in a row, 1 skipped in all)" in w for w in log.messages("WARNING"))

    # a clean step is applied and resets the count
    assert train_step(model, opt, guard, 1, [clean_batch(1)], lr=0.1) is True
    assert param_checksum(model) != before
    assert guard.consecutive_skips == 0

    assert train_step(model, opt, guard, 2, [with_token(clean_batch(2), PAD)], lr=0.1) is False
    assert train_step(model, opt, guard, 3, [with_token(clean_batch(3), PAD)], lr=0.1) is False
    with pytest.raises(NanStop) as stop:
        train_step(model, opt, guard, 4, [with_token(clean_batch(4), PAD)], lr=0.1)
    assert stop.value.exit_code == ExitCode.NAN
    assert saved == [tmp_path / "nan_grad_step_4.pt"]
    assert guard.skipped_steps == [0, 2, 3, 4]
    assert "[CPU 0] Stopping at step 4 (3 non-finite steps in a row > debug.max_nan_skips=2); exit code 6" \
        in log.messages("ERROR")
    assert sorted(p.name for p in (tmp_path / "debug").iterdir()) == [
        f"nan_debug_step_{s}.pkl" for s in (0, 2, 3, 4)]


def test_huge_learning_rate_blows_up_and_production_mode_still_reports(tmp_path, model, log):
    """No debug hooks (production): AdamW at lr=1e6 diverges within a few steps."""
    guard = make_guard(model, make_config(tmp_path, hooks=False))
    assert not any(m._forward_hooks for m in model.modules())
    opt = torch.optim.AdamW(model.parameters(), lr=1e6)
    applied = 0
    with pytest.raises(NanStop) as stop:
        for step in range(20):
            assert train_step(model, opt, guard, step, [clean_batch(step)], lr=1e6)
            applied += 1
    assert applied >= 1 and stop.value.step == applied
    lines = log.messages("ERROR")
    assert any(line.endswith("DETECTED [CPU 0]") for line in lines)
    assert "(set debug.nan_hooks=true to name the first module whose output goes non-finite)" in lines
    data = pickle.loads((tmp_path / "debug" / f"nan_debug_step_{applied}.pkl").read_bytes())
    assert data["first_bad_module"] is None and data["affected_layers"]
    assert data["lr"] == 1e6


def test_detection_off_means_no_check_at_all(tmp_path, model, log):
    cfg = make_config(tmp_path)
    cfg.debug.nan_detection = False
    guard = make_guard(model, cfg)
    assert not any(m._forward_hooks for m in model.modules())  # no probes either
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert train_step(model, opt, guard, 0, [with_token(clean_batch(0), POISON)], lr=0.1) is True
    assert not tmp_path.exists() or not any(tmp_path.rglob("*"))


def test_failing_checkpoint_keeps_the_nan_exit_and_the_pickle(tmp_path, model, log):
    def broken(path: Path) -> None:
        raise OSError("disk full")

    guard = make_guard(model, make_config(tmp_path), broken)
    with pytest.raises(NanStop) as stop:
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), guard, 7,
                   [with_token(clean_batch(0), POISON)], lr=0.1)
    assert stop.value.exit_code == ExitCode.NAN and stop.value.checkpoint is None
    assert (tmp_path / "debug" / "nan_debug_step_7.pkl").is_file()
    lines = log.messages("ERROR")
    assert any("Checkpoint NOT saved to" in line and "OSError: disk full" in line for line in lines)
    assert not any(line.startswith("Checkpoint saved") for line in lines)


def test_fp16_amp_leaves_gradient_overflow_to_the_grad_scaler_but_stops_on_a_nan_loss(tmp_path, model, log):
    cfg = make_config(tmp_path)
    cfg.training.use_amp, cfg.training.amp_dtype = True, "fp16"
    guard = make_guard(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # finite loss, NaN gradients: what a GradScaler overflow looks like -> the scaler skips it
    assert train_step(model, opt, guard, 0, [with_token(clean_batch(0), PAD)], lr=0.1) is True
    assert log.messages("ERROR") == []
    with pytest.raises(NanStop):
        train_step(model, opt, guard, 1, [with_token(clean_batch(1), POISON)], lr=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_inf_parameter_on_cuda_stops_and_dumps(tmp_path, log):
    torch.manual_seed(0)
    model = TinyLM().cuda()
    guard = make_guard(model, make_config(tmp_path))
    with torch.no_grad():
        model.layers[0].feed_forward.w1.weight[0, 0] = float("inf")
    with pytest.raises(NanStop):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), guard, 0, [clean_batch(0).cuda()], lr=0.1)
    assert "NaN LOSS DETECTED [CPU 0]" in log.messages("ERROR")  # make_guard's identity is a CPU worker
    assert "First non-finite module (forward): layers.0.feed_forward.w1 (micro-batch 0)" in log.messages("ERROR")
    data = pickle.loads((tmp_path / "debug" / "nan_debug_step_0.pkl").read_bytes())
    assert data["device"].startswith("cuda:0") and np.isinf(data["parameters"]["layers.0.feed_forward.w1.weight"][0, 0])
