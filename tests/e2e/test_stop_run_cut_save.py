"""A second SIGTERM during the built-in trainer's final save: the save is cut, and the run says
so (exit 1, "NOT saved", final_save "not saved"), names the newest complete checkpoint, and
leaves no temporary file of the cut save beside the checkpoints."""

from __future__ import annotations

import signal
import subprocess
import sys

import orjson

from tests.e2e.helpers import records
from tests.supervisor.helpers import finish, wait_for


def test_a_second_sigterm_during_the_final_save_exits_1_and_leaves_no_temp_file(tmp_path, python_env):
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--nproc", "1", "--run-id", "cut"]
    for item in ("system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32",
                 "model.n_layers=8", "model.dim=512", "model.n_heads=8", "model.n_kv_heads=8",
                 "training.batch_size=1", "training.max_steps=100000", "training.warmup_steps=5",
                 "training.log_every=1", "training.eval_every=0", "training.save_every=2", "training.keep_last=1"):
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run_dir, checkpoints = tmp_path / "logs" / "cut", tmp_path / ".checkpoints"
    try:
        assert wait_for(lambda: any(r["step"] >= 2 for r in records(run_dir, "checkpoint")), timeout=240)
        proc.send_signal(signal.SIGTERM)  # save and stop: the final save of a ~25M-parameter model
        assert wait_for(lambda: any(checkpoints.glob(".step_*.tmp")), timeout=120, interval=0.005)
        proc.send_signal(signal.SIGTERM)  # again: kill now
    finally:
        code, _out, err = finish(proc, timeout=120)
    assert code == 1, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["final_save"] == "not saved"
    message = summary["root_cause"]["message"]
    assert "the final checkpoint was NOT saved" in message
    assert "the newest complete checkpoint of this run is " + str(checkpoints / "step_") in message, message
    assert not list(checkpoints.glob(".*.tmp")), list(checkpoints.iterdir())
