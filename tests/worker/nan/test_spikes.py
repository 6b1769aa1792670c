"""Loss spikes: the running threshold, each policy on a spike made by scaling one
batch's loss, and the promise that a healthy step still costs one host sync."""

from __future__ import annotations

import os
import pickle
from collections import Counter

import pytest
import torch

from gpuherd.exit_codes import ExitCode
from tests.worker.nan.helpers import LogCapture, TinyLM, clean_batch, make_guard, param_checksum
from tests.worker.nan.replay_helpers import LossScale, records, replayable_step, status_file, suspicious_config
from worker.nan import NanStop
from worker.nan.spikes import MAD_TO_SIGMA, RunningThreshold

WARM = 5  # clean steps before the spike: past spike_warmup=3 with a few to spare
SPIKE = LossScale(always=1000.0)


@pytest.fixture
def log():
    capture = LogCapture()
    yield capture
    capture.close()


@pytest.fixture
def model() -> TinyLM:
    """Seeded, so a twin built the same way starts from the same weights."""
    torch.manual_seed(0)
    return TinyLM()


def batches(step: int) -> list[torch.Tensor]:
    return [clean_batch(2 * step), clean_batch(2 * step + 1)]


def warm_up(model, opt, guard) -> None:
    for step in range(WARM):
        assert replayable_step(model, opt, guard, step, batches(step), lr=0.1) is True


def test_threshold_is_median_plus_k_mad_judged_after_warmup_over_a_window():
    th = RunningThreshold(window=5, warmup=3, k=2.0)
    assert not th.exceeds(torch.tensor(1e9)).item()  # nothing seen: never judged
    for value in (1.0, 2.0):
        th.observe(torch.tensor(value))
    assert not th.exceeds(torch.tensor(1e9)).item()  # still warming up
    th.observe(torch.tensor(3.0))
    state = th.read()
    assert (state.median, state.mad) == (2.0, 1.0)
    assert state.threshold == pytest.approx(2.0 + 2.0 * MAD_TO_SIGMA * 1.0)
    assert not th.exceeds(torch.tensor(4.9)).item() and th.exceeds(torch.tensor(5.0)).item()
    assert not th.exceeds(torch.tensor(-100.0)).item()  # one-sided: a falling loss is fine
    assert not th.exceeds(torch.tensor(float("nan"))).item()  # NaN is the finite check's business
    for _ in range(5):  # a full window of 10s pushes the old values out
        th.observe(torch.tensor(10.0))
    state = th.read()
    assert (state.median, state.mad) == (10.0, 0.0)
    # no spread at all: 1% of the median stands in for it
    assert state.threshold == pytest.approx(10.0 + 2.0 * 0.1)


def test_spike_policy_stop_reports_dumps_checkpoints_and_exits_6(tmp_path, model, log, capsys):
    saved = []
    fd = status_file(tmp_path / "status.jsonl")
    guard = make_guard(model, suspicious_config(tmp_path / "ckpt", spike_policy="stop"), saved.append, status_fd=fd)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, opt, guard)
    with pytest.raises(NanStop) as stop:
        replayable_step(model, opt, guard, WARM, batches(WARM), lr=0.1, scale=SPIKE)
    os.close(fd)
    assert stop.value.exit_code == ExitCode.NAN and "loss spike at step 5" in str(stop.value)
    lines = log.messages("ERROR")
    assert "LOSS SPIKE DETECTED [CPU 0]" in lines
    assert any(line.startswith("Loss threshold: ") and "over the last 5 applied steps" in line for line in lines)
    assert lines[-1] == "[CPU 0] Stopping at step 5 (debug.spike_policy=stop); exit code 6"
    assert saved == [tmp_path / "ckpt" / "nan_grad_step_5.pt"]
    data = pickle.loads((tmp_path / "ckpt" / "debug" / "nan_debug_step_5.pkl").read_bytes())
    assert data["kind"] == "loss_spike" and data["action"] == "stop" and data["parameters"] == {}
    assert data["loss"] > data["spike"]["thresholds"]["loss"]["threshold"]
    assert len(data["batch"]) == 4 and data["batch"][0]["token_head"] == batches(WARM)[0][0].tolist()
    assert data["gradient_norms"]  # which layers the spike's gradient went to
    (spike,) = [r for r in records(tmp_path / "status.jsonl") if r["type"] == "spike"]
    assert (spike["step"], spike["metric"], spike["action"], spike["ranks"]) == (5, "loss", "stop", [0])
    assert spike["threshold"] < spike["loss"]
    from worker.nan.report import main

    assert main([str(tmp_path / "ckpt" / "debug" / "nan_debug_step_5.pkl")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[:3] == ["=" * 80, "LOSS SPIKE DETECTED [CPU 0]", "=" * 80]
    assert "Samples (4):" in printed and printed[printed.index("Samples (4):") + 1].startswith(
        "  • rank 0 micro-batch 0 row 0: [")


def test_spike_policy_skip_drops_the_step_and_training_goes_on(tmp_path, model, log):
    fd = status_file(tmp_path / "status.jsonl")
    guard = make_guard(model, suspicious_config(tmp_path, spike_policy="skip"), status_fd=fd)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, opt, guard)
    before = param_checksum(model)
    assert replayable_step(model, opt, guard, WARM, batches(WARM), lr=0.1, scale=SPIKE) is False
    assert param_checksum(model) == before
    assert any("debug.spike_policy=skip: step 5 not applied (1/3 in a row" in w for w in log.messages("WARNING"))
    # the spike did not enter the history: the next ordinary step is judged healthy and applied
    assert replayable_step(model, opt, guard, WARM + 1, batches(WARM + 1), lr=0.1) is True
    assert param_checksum(model) != before
    os.close(fd)
    (spike,) = [r for r in records(tmp_path / "status.jsonl") if r["type"] == "spike"]
    assert spike["action"] == "skip" and spike["classification"] is None


def test_spike_policy_rerun_a_spike_that_comes_back_is_the_batch_exit_9(tmp_path, model, log):
    guard = make_guard(model, suspicious_config(tmp_path, spike_policy="rerun"), lambda path: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, opt, guard)
    scale = LossScale(always=1000.0)
    with pytest.raises(NanStop) as stop:
        replayable_step(model, opt, guard, WARM, batches(WARM), lr=0.1, scale=scale)
    assert scale.runs == 2  # the step ran once more to be compared
    assert stop.value.exit_code == ExitCode.DATA_MODEL
    lines = log.messages("ERROR")
    assert ("Replayed on the same device: bit-identical on every rank -> the batch or the model is at fault,"
            " not the device") in lines
    assert "Batch (4 sample(s) on this rank):" in lines
    data = pickle.loads((tmp_path / "debug" / "nan_debug_step_5.pkl").read_bytes())
    assert data["classification"] == "reproducible" and data["rerun"][0]["loss"] == data["rerun"][0]["replay_loss"]
    guard.detach()


def test_spike_policy_rerun_a_one_off_spike_is_transient_and_the_step_is_retried(tmp_path, model, log):
    guard = make_guard(model, suspicious_config(tmp_path, spike_policy="rerun"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    twin = TinyLM()
    twin.load_state_dict(model.state_dict())
    twin_guard = make_guard(twin, suspicious_config(tmp_path / "twin", spike_policy="rerun"))
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    warm_up(model, opt, guard)
    warm_up(twin, twin_opt, twin_guard)
    assert replayable_step(model, opt, guard, WARM, batches(WARM), lr=0.1, scale=LossScale(once=1000.0)) is True
    assert replayable_step(twin, twin_opt, twin_guard, WARM, batches(WARM), lr=0.1) is True
    assert param_checksum(model) == param_checksum(twin)  # the replay's gradients were applied
    loss, _ = guard.retried
    assert loss.item() == pytest.approx(sum(twin(b).item() for b in batches(WARM)) / 2, rel=0.1)
    assert any("Transient fault at step 5: the loss spike did not reproduce on replay" in w
               and "suspect device: rank 0 [CPU 0] cpu" in w for w in log.messages("WARNING"))
    guard.detach()
    twin_guard.detach()


def test_spike_policy_off_judges_nothing(tmp_path, model):
    guard = make_guard(model, suspicious_config(tmp_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, opt, guard)
    assert replayable_step(model, opt, guard, WARM, batches(WARM), lr=0.1, scale=SPIKE) is True
    assert guard.spikes is None


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


@pytest.mark.parametrize("spike_policy", ["off", "rerun"])
def test_a_healthy_step_reads_one_value_back_from_the_device(tmp_path, model, monkeypatch, spike_policy):
    """Every way a tensor reaches the host is counted inside begin_step + check: a
    healthy step costs the one read of the decision, spikes judged or not."""
    cfg = suspicious_config(tmp_path, nan_policy="rerun", spike_policy=spike_policy)
    guard = make_guard(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, opt, guard)  # past the warm-up: spikes are judged from here on
    counts: Counter[str] = Counter()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for step in range(WARM, WARM + 3):
        opt.zero_grad(set_to_none=True)
        loss = sum(model(b) for b in batches(step)) / 2
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        counts.clear()
        guard.begin_step(None)
        assert guard.check(step=step, loss=loss.detach(), grad_norm=norm, batches=batches(step), lr=0.1)
        assert counts == Counter({"tolist": 1}), counts
        opt.step()
    guard.detach()


def test_under_fp16_an_overflowing_gradient_norm_is_the_scalers_business_not_a_spike(tmp_path, model):
    cfg = suspicious_config(tmp_path, spike_policy="stop")
    cfg.training.use_amp, cfg.training.amp_dtype = True, "fp16"
    guard = make_guard(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm_up(model, opt, guard)
    guard.begin_step(None)
    assert guard.check(step=WARM, loss=torch.tensor(3.4), grad_norm=torch.tensor(float("inf")), batches=[], lr=0.1)
    assert guard.spikes.grad_norm.seen == WARM  # and the overflow did not enter the history
    guard.detach()
