"""The training loop in one process: schedule, step line, status records, checkpoints, resume."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tests.worker import helpers as h

from gpuherd.checkpoint_layout import latest_checkpoint, list_checkpoints
from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.text import format_duration
from worker.distributed import WorkerError
from worker.mfu import FlopsModel, peak_flops
from worker.reporting import step_line
from worker.schedule import WarmupCosine
from worker.train import run

STEP_LINE = re.compile(
    r"^\[(GPU|CPU) \d+\] Step \[\d+/\d+\] \| Loss: \d+\.\d{4} \| LR: \d\.\d{2}e[-+]\d{2} \| "
    r"Grad Norm: \d+\.\d{4} \| ETA: (\d+:)?\d+:\d{2} \| Tok/s: \d+ \| MFU: (\d+\.\d%|n/a \| TFLOP/s: \d+\.\d{3})$"
)
IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cpu",
                          device_id=0, supervised=False)


def train(tmp: Path, *extra: str, status_name: str = "status.jsonl") -> tuple[int, list[dict]]:
    cfg = h.tiny_config(tmp, *extra)
    path = tmp / status_name
    code = run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(path, 0), run_dir=tmp / "run",
               install_signals=False)
    return code, h.read_status(path)


def test_warmup_then_cosine():
    lr = WarmupCosine(peak_lr=1e-3, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr(s) for s in range(4)] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4])
    assert lr(4) == pytest.approx(1e-3)
    assert lr(9) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr(14) == pytest.approx(1e-4) and lr(100) == pytest.approx(1e-4)


def test_mfu_formula_and_peaks():
    flops = FlopsModel.for_model(matmul_params=1000, n_layers=2, n_heads=4, head_dim=8, seq_len=16,
                                 device_name="NVIDIA H100 80GB HBM3")
    assert flops.flops_per_token == 6 * 1000 + 12 * 2 * 4 * 8 * 16
    assert flops.mfu(1e9) == pytest.approx(1e9 * flops.flops_per_token / 989e12)
    assert peak_flops("cpu") is None and FlopsModel(1.0, None).mfu(5.0) is None


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835), ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA GH200 480GB", 989),
    ("NVIDIA H800", 989), ("NVIDIA H20", 148), ("NVIDIA L40S", 362), ("NVIDIA L4", 121),
    ("NVIDIA GeForce RTX 4090", 165), ("NVIDIA RTX A6000", 155), ("NVIDIA B200", 2250), ("NVIDIA A10G", None),
])
def test_peak_table_matches_whole_names(name: str, tflops: int | None):
    # "H20" must not read "H200", "L4" not "L40S", "H200" not "GH200"; the longest key wins
    assert peak_flops(name) == (None if tflops is None else tflops * 1e12)


def test_step_line_matches_the_seed_format():
    known = FlopsModel(1e9, 989e12)
    line = step_line("[GPU 0]", 0, 10, 10.98765, 1e-5, 2.75654, 5.2, 1234.4, known)
    assert line.startswith("[GPU 0] Step [0/10] | Loss: 10.9877 | LR: 1.00e-05 | Grad Norm: 2.7565 | ETA: 0:05 | ")
    assert STEP_LINE.match(line) and line.endswith("MFU: 0.1%")
    assert STEP_LINE.match(step_line("[CPU 1]", 3, 10, 1.0, 3e-4, 0.5, 4000, 10, FlopsModel(1e9, None)))
    assert format_duration(330) == "5:30" and format_duration(3723) == "1:02:03"


def test_run_logs_reports_and_saves(tmp_path: Path, capfd):
    code, records = train(tmp_path, "training.eval_every=3", "training.eval_steps=2", "training.log_every=2")
    assert code == 0
    err = capfd.readouterr().err
    lines = [ln.split("INFO | ", 1)[1] for ln in err.splitlines() if "] Step [" in ln]
    assert [ln.split(" | ")[0] for ln in lines] == [f"[CPU 0] Step [{s}/6]" for s in (0, 2, 4, 5)]
    assert all(STEP_LINE.match(ln) for ln in lines), lines
    assert all(ln.startswith("CPU0:INFO | ") for ln in err.splitlines() if "] Step [" in ln)
    types = [r["type"] for r in records]
    assert types[0] == "ready" and types[-1] == "done" and records[-1]["step"] == 6
    evals = [r for r in records if r["type"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6] and all(math.isfinite(e["val_loss"]) for e in evals)
    ckpts = [r for r in records if r["type"] == "checkpoint"]
    assert ckpts[-1]["path"].endswith("step_0000006.pt")
    step = next(r for r in records if r["type"] == "step" and "loss" in r)
    assert set(step) >= {"step", "max_steps", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_bytes"}
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_is_bit_identical_and_restores_everything(tmp_path: Path):
    code, straight = train(tmp_path / "a", "training.save_every=3")
    assert code == 0
    mid = tmp_path / "a" / "ckpt" / "step_0000003.pt"
    ckpt = torch.load(mid, weights_only=True)  # loadable without unpickling arbitrary objects
    assert ckpt["meta"]["step"] == 3 and ckpt["meta"]["sampler"][0] == {"batches_drawn": 6}
    assert set(ckpt["meta"]["rng"][0]) == {"python", "numpy", "torch"}
    code, resumed = train(tmp_path / "b", f"training.resume={mid}")
    assert code == 0
    losses = {r["step"]: r["loss"] for r in straight if r["type"] == "step"}
    again = {r["step"]: r["loss"] for r in resumed if r["type"] == "step"}
    assert sorted(again) == [3, 4, 5]
    assert all(again[s] == losses[s] for s in again)  # exactly, not approximately


def test_resume_auto_picks_the_latest_and_keep_last_prunes(tmp_path: Path):
    code, _ = train(tmp_path, "training.save_every=1", "training.keep_last=2")
    assert code == 0
    ckpt_dir = tmp_path / "ckpt"
    assert [s for s, _ in list_checkpoints(ckpt_dir)] == [5, 6]
    assert not list(ckpt_dir.glob("*.tmp"))
    assert latest_checkpoint(ckpt_dir).name == "step_0000006.pt"
    code, records = train(tmp_path, "training.resume=auto", "training.max_steps=8", status_name="more.jsonl")
    assert code == 0
    assert [r["step"] for r in records if r["type"] == "step"] == [6, 7]


def test_resume_auto_without_checkpoints_starts_fresh(tmp_path: Path):
    code, records = train(tmp_path, "training.resume=auto", "training.max_steps=2")
    assert code == 0 and [r["step"] for r in records if r["type"] == "step"] == [0, 1]


def test_resume_with_another_model_is_a_clear_error(tmp_path: Path):
    train(tmp_path, "training.max_steps=2")
    with pytest.raises(WorkerError, match="different model.*dim") as info:
        train(tmp_path, "training.resume=auto", "model.dim=64", "model.n_heads=4")
    assert info.value.exit_code == ExitCode.USAGE


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path):
    bad = tmp_path / "ckpt" / "step_0000009.pt"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(WorkerError, match="step_0000009.pt is not a gpuherd checkpoint$") as info:
        train(tmp_path, f"training.resume={bad}")
    assert info.value.exit_code == ExitCode.USAGE


def test_nan_guard_stops_with_exit_code_6(tmp_path: Path):
    from gpuherd.status_channel import StatusWriter
    from worker.main import guarded

    cfg = h.tiny_config(tmp_path, "debug.nan_detection=true", "debug.nan_hooks=false", "debug.nan_policy=stop",
                        "training.learning_rate=1e30", "training.warmup_steps=0", "training.max_grad_norm=0")
    status = h.status_writer(tmp_path / "status.jsonl", 0)
    code = guarded(lambda: run(cfg, IDENTITY, data=h.bundle(cfg), status=status, install_signals=False),
                   StatusWriter(None, 0))
    assert code == ExitCode.NAN
    assert list((tmp_path / "ckpt").glob("nan_grad_step_*.pt"))  # the guard saved through our checkpointer
    steps = [r["step"] for r in h.read_status(tmp_path / "status.jsonl") if r["type"] == "step"]
    assert steps and max(steps) < 5


def test_nan_guard_skip_policy_keeps_training(tmp_path: Path):
    code, records = train(tmp_path, "debug.nan_detection=true", "debug.nan_hooks=false", "debug.nan_policy=skip",
                          "debug.max_nan_skips=100", "training.learning_rate=1e30", "training.warmup_steps=0",
                          "training.max_grad_norm=0", "training.max_steps=4")
    assert code == 0 and records[-1]["type"] == "done"
