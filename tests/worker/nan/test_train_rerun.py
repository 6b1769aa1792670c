"""Policy rerun through the worker's own loop (`worker.train.run`, one process): the
seam in train.py keeps the step replayable, reports the retried step's values, and
a reproducible blow-up names the batch in the sampler's terms and exits 9."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch

from gpuherd.contract import WorkerIdentity
from gpuherd.exit_codes import ExitCode
from gpuherd.status_channel import StatusWriter
from tests.worker import helpers as h
from worker.main import guarded
from worker.train import run

IDENTITY = WorkerIdentity(rank=0, local_rank=0, world_size=1, local_world_size=1, device_kind="cpu",
                          device_id=0, supervised=False)
RERUN = ["debug.nan_detection=true", "debug.nan_hooks=false", "debug.nan_policy=rerun"]


class FlakyBackward:
    """Corrupts one parameter's gradient on its `at`-th backward (counted over the
    run), once: what a flaky GPU does to one step and not to its replay."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return grad * float("nan") if self.calls == self.at else grad


def train(tmp: Path, *extra: str, fault: FlakyBackward | None = None, monkeypatch=None) -> tuple[int, list[dict]]:
    if fault is not None:
        import worker.train

        build = worker.train.build_engine

        def build_with_fault(*args, **kwargs):
            engine = build(*args, **kwargs)
            engine.inner.layers[0].feed_forward.w2.weight.register_hook(fault)
            return engine

        monkeypatch.setattr(worker.train, "build_engine", build_with_fault)
    cfg = h.tiny_config(tmp, *extra)
    path = tmp / "status.jsonl"
    code = guarded(lambda: run(cfg, IDENTITY, data=h.bundle(cfg), status=h.status_writer(path, 0),
                               install_signals=False), StatusWriter(None, 0))
    return code, h.read_status(path)


def test_a_flaky_backward_is_retried_and_the_run_logs_the_losses_of_a_clean_run(tmp_path, monkeypatch):
    (tmp_path / "clean").mkdir()
    (tmp_path / "flaky").mkdir()
    clean_code, clean = train(tmp_path / "clean", *RERUN)
    fault = FlakyBackward(at=5)  # step 2's first micro-batch (2 micro-batches per step)
    code, flaky = train(tmp_path / "flaky", *RERUN, fault=fault, monkeypatch=monkeypatch)
    assert (clean_code, code) == (0, 0)
    assert fault.calls > 12  # the fault fired, and the step ran once more
    losses = [(r["step"], r["loss"], r["grad_norm"]) for r in flaky if r["type"] == "step" and "loss" in r]
    assert losses == [(r["step"], r["loss"], r["grad_norm"]) for r in clean if r["type"] == "step" and "loss" in r]
    assert len(losses) == 6
    (nan,) = [r for r in flaky if r["type"] == "nan"]
    assert (nan["step"], nan["action"], nan["classification"], nan["culprits"]) == (2, "retried", "transient", [0])
    assert [r["transient_faults"] for r in flaky if r["type"] == "suspect"] == [1]


def test_a_reproducible_blow_up_names_the_batch_and_exits_8(tmp_path):
    code, records = train(tmp_path, *RERUN, "training.learning_rate=1e30", "training.warmup_steps=0",
                          "training.max_grad_norm=0")
    assert code == ExitCode.DATA_MODEL
    (nan,) = [r for r in records if r["type"] == "nan"]
    assert nan["classification"] == "reproducible" and nan["action"] == "stop"
    assert Path(nan["checkpoint"]).is_file()
    data = pickle.loads(Path(nan["report"]).read_bytes())
    stream = h.tokens(20_000, 1)  # the in-memory training tokens h.bundle samples from
    assert len(data["batch"]) == 4  # batch_size 2 x 2 micro-batches
    for name, (m, r) in zip(data["batch"], [(0, 0), (0, 1), (1, 0), (1, 1)], strict=True):
        assert (name["micro_batch"], name["row"]) == (m, r)
        assert name["sample"] == 2 * (2 * nan["step"] + m) + r  # draws so far x batch size + row
        start = name["token_offset"]
        assert np.array_equal(stream[start:start + 16], data["batch_token_ids"][m][r])
        assert np.array_equal(stream[start + 1:start + 17], data["batch_target_ids"][m][r])


def test_rerun_with_spikes_keeps_training_when_nothing_is_wrong(tmp_path):
    code, records = train(tmp_path, *RERUN, "debug.spike_policy=rerun", "debug.spike_warmup=2",
                          "training.max_steps=8")
    assert code == 0
    assert not [r for r in records if r["type"] in ("nan", "spike", "suspect")]

