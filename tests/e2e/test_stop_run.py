"""Stopping a real training run loses nothing: a stop request (SIGTERM as scancel or a
preemption sends it, SIGUSR1 as SLURM's `--signal=USR1@T` sends it) makes gpuherd's own
workers finish the step, save and exit 143; Ctrl-C during the save of a ~50M-parameter
model waits for the save instead of cutting it at the grace period."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from tests.supervisor.helpers import finish, wait_for

TINY = [
    "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
    "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.grad_accum_nums=1", "training.max_steps=100000", "training.warmup_steps=5", "training.log_every=1",
    "training.eval_every=0", "training.save_every=0",
]
# ~53M parameters, nearly all in the embedding and output matrices: a step takes little
# time, a save of its ~640 MB (weights + AdamW's moments) much more than the grace period.
FIFTY_M = [
    "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=16", "model.n_layers=1", "model.dim=512",
    "model.n_heads=8", "model.n_kv_heads=8", "model.vocab_size=49152", "training.batch_size=1",
    "training.grad_accum_nums=1", "training.max_steps=100000", "training.warmup_steps=2", "training.log_every=1",
    "training.eval_every=0", "training.save_every=3", "training.keep_last=2",
]


def _start(cwd: Path, env: dict[str, str], settings: list[str], *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--run-id", "r", *extra]
    for item in settings:
        cmd += ["--set", item]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_bytes().splitlines() if path.exists() else []:
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            continue  # a line being written right now
    return out


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_request_saves_a_checkpoint_and_exits_143(tmp_path, python_env, signum):
    proc = _start(tmp_path, python_env, TINY, "--nproc", "2")
    run_dir = tmp_path / "logs" / "r"
    try:
        assert wait_for(lambda: any(r.get("type") == "step" and r.get("step", 0) >= 3 for r in _records(run_dir)),
                        timeout=240)
        proc.send_signal(signum)
    finally:
        code, _, err = finish(proc, timeout=240)
    assert code == 143, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["root_cause"]["kind"] == "terminated" and summary["final_save"] == "saved"
    assert [w["role"] for w in summary["workers"]] == ["stopped", "stopped"]
    assert all(w["signals_sent"] == ["SIGUSR2"] and w["exit_code"] == 143 for w in summary["workers"])
    saved = [r for r in _records(run_dir) if r.get("type") == "checkpoint"]
    last = max(r["step"] for r in saved)
    checkpoint = _load(tmp_path / ".checkpoints" / f"step_{last:07d}.pt")
    assert checkpoint["meta"]["step"] == last
    assert last == 1 + max(r["step"] for r in _records(run_dir) if r.get("type") == "step")  # every step done is in it
    assert f"checkpoint step {last} saved: {tmp_path / '.checkpoints' / f'step_{last:07d}.pt'}" in err
    assert "FAILED" not in err and "most recent call first" not in err  # a planned stop: no failure, no stacks
    assert f"gpuherd: run r stopped (exit 143)\nroot cause: the supervisor received {signal.Signals(signum).name}" in err


@pytest.mark.slow
def test_ctrl_c_during_the_save_of_a_50m_model_waits_for_the_save(tmp_path, python_env):
    """The grace period (0.3 s) is far shorter than the save: the supervisor waits while the
    worker reports phase checkpoint, and the checkpoint is complete and loadable. (Ctrl-C
    lands in a periodic save; the worker stops right after it, with nothing new to save.)"""
    proc = _start(tmp_path, python_env, FIFTY_M, "--nproc", "1", "--grace-period", "0.3")
    run_dir = tmp_path / "logs" / "r"

    def saving() -> bool:
        records = _records(run_dir)
        return bool(records) and records[-1].get("type") == "phase" and records[-1].get("name") == "checkpoint"
    try:
        assert wait_for(saving, timeout=300, interval=0.01)
        proc.send_signal(signal.SIGINT)
    finally:
        code, _, err = finish(proc, timeout=300)
    assert code == 130, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    # saved, then on its way out (a grace period after the save, it may be killed exiting: nothing is lost then)
    assert summary["final_save"] == "saved" and summary["workers"][0]["phase"] == "shutdown"
    assert "still saving a checkpoint: waiting for it" in err
    last = max(r["step"] for r in _records(run_dir) if r.get("type") == "checkpoint")
    checkpoint = _load(tmp_path / ".checkpoints" / f"step_{last:07d}.pt")
    n_params = sum(t.numel() for t in checkpoint["model"].values())
    assert 50e6 < n_params < 60e6 and checkpoint["meta"]["step"] == last
    assert not list((tmp_path / ".checkpoints").glob("*.tmp"))  # no half-written save left behind


@pytest.mark.slow
def test_a_stop_signal_to_one_worker_stops_and_saves_every_worker(tmp_path, python_env):
    """SLURM (proctrack linuxproc/cgroup) signals the workers themselves; here only rank 1 gets
    SIGTERM, and no supervisor signal at all: the worker tells its supervisor, which stops
    every rank, and the checkpoint holds the step they agreed on."""
    proc = _start(tmp_path, python_env, TINY, "--nproc", "2")
    run_dir = tmp_path / "logs" / "r"
    try:
        assert wait_for(lambda: any(r.get("type") == "step" and r.get("step", 0) >= 2 for r in _records(run_dir)),
                        timeout=240)
        worker = next(r["pid"] for r in _records(run_dir) if r.get("type") == "ready" and r.get("rank") == 1)
        os.kill(worker, signal.SIGTERM)
    finally:
        code, _, err = finish(proc, timeout=240)
    assert code == 143, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["root_cause"]["message"].startswith("CPU1 (rank 1) received SIGTERM; checkpoint step ")
    assert summary["final_save"] == "saved" and [w["exit_code"] for w in summary["workers"]] == [143, 143]
    assert "exiting now" not in err
