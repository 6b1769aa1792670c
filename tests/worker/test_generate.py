"""generate.py: KV-cached sampling from a real checkpoint, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.worker import helpers as h

from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from worker.distributed import WorkerError
from worker.inference import generate, load_for_inference, resolve_checkpoint
from worker.train import run

IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cpu",
                          device_id=0, supervised=False)


def trained(tmp: Path) -> Path:
    cfg = h.tiny_config(tmp, "training.max_steps=3")
    assert run(cfg, IDENTITY, data=h.bundle(cfg, tokenizer="byte"), install_signals=False) == 0
    return tmp / "ckpt"


def test_cached_decoding_equals_recomputing_the_whole_sequence(tmp_path: Path):
    loaded = load_for_inference(trained(tmp_path), torch.device("cpu"))
    model, prompt = loaded.model, [10, 20, 30, 40]
    fast = generate(model, prompt, 8, 0.0, 0, torch.Generator())
    slow = list(prompt)
    with torch.no_grad():
        while len(slow) < len(fast):
            slow.append(int(model(torch.tensor([slow]))[0, -1].argmax()))
    assert fast == slow


def test_sampling_is_seeded_and_respects_the_context(tmp_path: Path):
    loaded = load_for_inference(trained(tmp_path), torch.device("cpu"))
    a = generate(loaded.model, [1, 2], 6, 1.0, 5, torch.Generator().manual_seed(3))
    b = generate(loaded.model, [1, 2], 6, 1.0, 5, torch.Generator().manual_seed(3))
    assert a == b and len(a) == 8
    long = generate(loaded.model, list(range(40)), 50, 0.0, 0, torch.Generator())
    assert len(long) == h.CONTEXT  # the prompt's tail plus what still fits


def test_cli_prints_the_continuation(tmp_path: Path):
    ckpt = trained(tmp_path)
    res = h.spawn([str(h.REPO / "generate.py"), "--checkpoint", str(ckpt), "--prompt", "Once upon a time",
                   "--max-new-tokens", "5", "--temperature", "0"], [h.worker_env(0, 1, 0, PYTHONPATH="")], timeout=60,
                  cwd=tmp_path)[0]
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Once upon a time")
    assert "step 3" in res.stderr


def test_cli_errors_are_one_line(tmp_path: Path):
    missing = h.spawn(["generate.py", "--checkpoint", str(tmp_path / "nope.pt"), "--prompt", "x"],
                      [h.worker_env(0, 1, 0)], timeout=60)[0]
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"generate.py: error: checkpoint not found: {tmp_path / 'nope.pt'}"]
    garbage = tmp_path / "bad.pt"
    garbage.write_bytes(b"garbage")
    bad = h.spawn(["generate.py", "--checkpoint", str(garbage)], [h.worker_env(0, 1, 0)], timeout=60)[0]
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [f"generate.py: error: {garbage} is not a gpuherd checkpoint"]


def test_a_directory_without_checkpoints_is_refused(tmp_path: Path):
    (tmp_path / "step_0000001").mkdir()  # an unfinished directory checkpoint (no meta.pt) does not count
    with pytest.raises(WorkerError, match="holds no complete gpuherd checkpoint") as info:
        resolve_checkpoint(tmp_path)
    assert info.value.exit_code == ExitCode.USAGE
