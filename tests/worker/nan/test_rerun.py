"""Policy rerun in one process: a one-off gradient corruption is transient (retried,
counted, the device named, the same weights as a clean run), a poisoned sample is
reproducible (the batch named down to its document, exit 9)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from dataset_cache import open_cache
from gpuherd.config import DataConfig
from gpuherd.exit_codes import ExitCode
from tests.worker.nan.helpers import LogCapture, TinyLM, clean_batch, make_guard, param_checksum
from tests.worker.nan.replay_helpers import GradientFault, records, replayable_step, status_file, suspicious_config
from worker.nan import NanStop
from worker.nan.rerun_policy import FaultLedger, RerunRecord, classify, same_bits

NAN = float("nan")


@pytest.fixture
def log():
    capture = LogCapture()
    yield capture
    capture.close()


def tiny(seed: int = 0, vocab: int = 32) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(vocab=vocab)


def batches(step: int) -> list[torch.Tensor]:
    return [clean_batch(2 * step), clean_batch(2 * step + 1)]


def test_a_one_off_gradient_fault_is_transient_retried_and_training_ends_where_a_clean_run_does(tmp_path, log):
    model, twin = tiny(), tiny()
    fd = status_file(tmp_path / "status.jsonl")
    guard = make_guard(model, suspicious_config(tmp_path, nan_policy="rerun"), status_fd=fd)
    twin_guard = make_guard(twin, suspicious_config(tmp_path / "twin", nan_policy="rerun"))
    fault = GradientFault(model.layers[0].feed_forward.w2.weight)
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    losses, twin_losses = [], []
    for step in range(5):
        fault.armed = step == 2
        assert replayable_step(model, opt, guard, step, batches(step), lr=1e-2) is True
        assert replayable_step(twin, twin_opt, twin_guard, step, batches(step), lr=1e-2) is True
        losses.append(sum(model(b).item() for b in batches(9)))
        twin_losses.append(sum(twin(b).item() for b in batches(9)))
    os.close(fd)
    assert fault.fired == 1 and losses == twin_losses  # bit for bit, the final loss included
    assert param_checksum(model) == param_checksum(twin)
    warning = next(w for w in log.messages("WARNING") if "Transient fault at step 2" in w)
    assert "the non-finite loss or gradient did not reproduce on replay" in warning
    assert "grad norm nan -> " in warning and warning.endswith("limit 2); step retried")
    assert "suspect device: rank 0 [CPU 0] cpu on " in warning and "(1 transient fault(s), limit 2)" in warning
    assert log.messages("ERROR") == []  # no banner, no dump: nothing was wrong with the model
    assert not (tmp_path / "debug").exists()
    nan, suspect = [r for r in records(tmp_path / "status.jsonl") if r["type"] in ("nan", "suspect")]
    assert (nan["step"], nan["action"], nan["classification"], nan["culprits"]) == (2, "retried", "transient", [0])
    assert nan["grad_norm"] == "nan" and isinstance(nan["replay_grad_norm"], float)
    assert (suspect["device"], suspect["transient_faults"], suspect["limit"], suspect["stopping"]) == ("cpu", 1, 2, False)
    guard.detach()
    twin_guard.detach()


def test_more_transient_faults_than_allowed_stop_with_exit_8(tmp_path, log):
    model = tiny()
    fd = status_file(tmp_path / "status.jsonl")
    guard = make_guard(model, suspicious_config(tmp_path, nan_policy="rerun", max_transient_faults=1), status_fd=fd)
    fault = GradientFault(model.tok_embed.weight, factor=float("inf"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fault.armed = True
    assert replayable_step(model, opt, guard, 0, batches(0), lr=0.1) is True
    fault.armed = True
    with pytest.raises(NanStop) as stop:
        replayable_step(model, opt, guard, 1, batches(1), lr=0.1)
    os.close(fd)
    assert stop.value.exit_code == ExitCode.DEVICE_SUSPECT == 8 and stop.value.ranks == [0]
    assert "suspect device: rank 0 had more than 1 transient faults (last at step 1)" == str(stop.value)
    assert log.messages("ERROR")[-1] == ("[CPU 0] Stopping at step 1: rank 0 had more than"
                                         " debug.max_transient_faults=1 transient faults; exit code 8")
    suspects = [r for r in records(tmp_path / "status.jsonl") if r["type"] == "suspect"]
    assert [(r["transient_faults"], r["stopping"]) for r in suspects] == [(1, False), (2, True)]
    guard.detach()


POISON_DOC = 17  # index of the document made of '~'
TILDE = ord("~")


def poisoned_source(tmp_path: Path):
    """A real dataset cache (byte tokenizer): 40 documents, one of them all '~'."""
    from dataset_cache import BatchSampler, open_cache, prepare_cache
    from worker.data import TensorBatches

    words = "the of and to in a is that for it as was with be by on not he this are".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, 20)) for _ in range(40)]
    docs[POISON_DOC] = "~" * 300
    corpus = tmp_path / "docs.jsonl"
    corpus.write_bytes(b"".join(orjson.dumps({"text": d}) + b"\n" for d in docs))
    data = DataConfig(dataset=str(corpus), tokenizer="byte", context_length=16, val_fraction=0.1,
                      cache_dir=str(tmp_path / "cache"))
    cache = open_cache(prepare_cache(data, workers=1).path)
    return cache, TensorBatches(BatchSampler(cache, "train", 4, 16, 0, 1, seed=3))


def test_a_poisoned_sample_reproduces_is_named_down_to_its_document_and_stops_with_exit_9(tmp_path, log):
    cache, source = poisoned_source(tmp_path)
    model = tiny(vocab=256)
    with torch.no_grad():
        model.tok_embed.weight[0].normal_(std=0.02)  # the end-of-text id: not TinyLM's zero PAD row here
        model.tok_embed.weight[TILDE].fill_(1e30)  # '~' overflows -> a NaN loss
    saved = []
    fd = status_file(tmp_path / "status.jsonl")
    guard = make_guard(model, suspicious_config(tmp_path / "ckpt", nan_policy="rerun", hooks=True), saved.append,
                       status_fd=fd)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NanStop) as stop:
        for step in range(40):
            guard.begin_step(source)  # as the worker's loop: before the step draws its batches
            windows = [torch.cat([x, y[:, -1:]], dim=1) for x, y in (source.next_batch() for _ in range(2))]
            replayable_step(model, opt, guard, step, windows, lr=0.01, begin=False)
    os.close(fd)
    assert stop.value.exit_code == ExitCode.DATA_MODEL == 9
    step = stop.value.step
    lines = log.messages("ERROR")
    assert "NaN LOSS DETECTED [CPU 0]" in lines
    assert any(line.startswith("Replayed on the same device: bit-identical on every rank") for line in lines)
    assert saved == [tmp_path / "ckpt" / f"nan_grad_step_{step}.pt"]
    data = pickle.loads((tmp_path / "ckpt" / "debug" / f"nan_debug_step_{step}.pkl").read_bytes())
    assert data["classification"] == "reproducible" and data["action"] == "stop"
    tokens = np.asarray(cache.tokens("train"))
    documents = np.asarray(cache.document_offsets())
    poisoned = [n for n in data["batch"] if TILDE in n["token_head"]]
    assert poisoned and len(data["batch"]) == 8
    for name in data["batch"]:  # every sample located, and the location is right
        start = name["token_offset"]
        assert tokens[start:start + 17].tolist() == name["token_head"][:17]
        assert documents[name["document"]] <= start < documents[name["document"] + 1]
        assert name["document_offset"] == start - documents[name["document"]]
        assert name["text_head"] == bytes(t for t in name["token_head"] if t).decode()
    assert any(n["document"] == POISON_DOC and n["text_head"].startswith("~~~") for n in poisoned)
    open_cache(cache.path)  # locating the samples never marks the good cache damaged
    assert any(line.startswith("  • rank 0 micro-batch ") and ", document " in line for line in lines)
    (nan,) = [r for r in records(tmp_path / "status.jsonl") if r["type"] == "nan"]
    assert (nan["classification"], nan["action"], nan["step"]) == ("reproducible", "stop", step)
    guard.detach()


def test_rerun_without_kept_state_stops_and_says_why(tmp_path, log):
    model = tiny()
    guard = make_guard(model, suspicious_config(tmp_path, nan_policy="rerun"))
    fault = GradientFault(model.tok_embed.weight)
    fault.armed = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    loss = model(clean_batch(0))
    loss.backward()
    with pytest.raises(NanStop) as stop:  # no begin_step, no replay: as under DeepSpeed
        guard.check(step=0, loss=loss.detach(), grad_norm=None, batches=[clean_batch(0)], lr=0.1)
    assert stop.value.exit_code == ExitCode.NAN
    assert any("debug.nan_policy=rerun, but this step cannot be replayed (no replay handed over" in w
               for w in log.messages("WARNING"))
    guard.detach()


def record(rank: int, loss: float, replay_loss: float, norm: float = NAN, replay_norm: float = 1.0,
           evidence: bool = False) -> RerunRecord:
    return RerunRecord(rank, f"[GPU {rank}]", "host", f"cuda:{rank}", loss, norm, replay_loss, replay_norm, evidence)


def test_classification_blames_the_rank_whose_own_result_changed():
    forward_fault = classify([record(0, 2.0, 2.0), record(1, NAN, 2.5)], suspicious_again=False)
    assert (forward_fault.label, forward_fault.culprits) == ("transient", [1])
    backward_fault = classify([record(0, 2.0, 2.0), record(1, 2.5, 2.5, evidence=True)], suspicious_again=False)
    assert backward_fault.culprits == [1]
    unknown = classify([record(0, 2.0, 2.0), record(1, 2.5, 2.5)], suspicious_again=False)
    assert unknown.transient and unknown.culprits == []
    same = classify([record(0, NAN, NAN, NAN, NAN)], suspicious_again=True)
    assert (same.label, same.identical) == ("reproducible", True)
    noisy = classify([record(0, 9.0, 9.5, 1.0, 1.0)], suspicious_again=True)  # kernels not deterministic
    assert (noisy.label, noisy.identical) == ("reproducible", False)
    ledger = FaultLedger()
    for culprits in ([1], [1], []):
        ledger.add(culprits)
    assert ledger.counts == {1: 2, None: 1} and ledger.over(1) == [1]


def test_same_bits_is_bitwise_with_nan_equal_to_nan():
    assert same_bits(NAN, -NAN) and same_bits(1.5, 1.5)
    assert not same_bits(0.0, -0.0) and not same_bits(1.0, np.nextafter(1.0, 2.0)) and not same_bits(NAN, 1.0)


def test_a_replay_under_a_grad_scaler_unscales_its_own_gradients_with_the_same_scale():
    from worker.nan.rerun_policy import clear_gradients

    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    grads = []
    for replay in (False, True):
        if replay:
            with pytest.raises(RuntimeError, match="unscale_"):  # what clipping a replay would hit
                scaler.unscale_(opt)
            clear_gradients(model, scaler)
        scaler.scale(model(clean_batch(0))).backward()
        scaler.unscale_(opt)
        grads.append(model.output.weight.grad.clone())
    assert torch.equal(grads[0], grads[1]) and scaler.get_scale() == 1024.0
    scaler.step(opt)
    scaler.update()
