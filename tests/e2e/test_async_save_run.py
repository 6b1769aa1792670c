"""Asynchronous checkpoints through the whole product: a teardown (another rank SIGKILLed)
lets rank 0's background write finish and the restart resumes from it; a SIGTERM to the
supervisor while that write can never finish ends with "NOT saved", and `--resume auto`
then takes the newest complete checkpoint, never the unfinished one."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import orjson
import psutil
import pytest

from tests.supervisor.helpers import finish, wait_for, worker_of
from worker.save_phases import PAUSE_VAR

TINY = [
    "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
    "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.grad_accum_nums=1", "training.max_steps=12", "training.warmup_steps=2", "training.log_every=1",
    "training.eval_every=0", "training.save_every=3", "training.keep_last=1",
]


def _command(*extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", "--nproc", "2",
           *extra]
    for item in TINY:
        cmd += ["--set", item]
    return cmd


def _worker_log(run_dir: Path, rank: int, attempt: int = 0) -> str:
    base = run_dir / f"attempt-{attempt}" if attempt else run_dir
    found = list(base.glob(f"worker-rank{rank}-*.log"))
    return found[0].read_text(errors="replace") if found else ""


def test_a_teardown_waits_for_the_background_write_and_the_restart_resumes_from_it(tmp_path, python_env):
    """Rank 0's write of step 6 is slow (held at `written` until the supervisor has said it
    waits for it, past the 2 s grace period); rank 1 is SIGKILLed meanwhile: rank 0 finishes
    the write before it exits, and the restarted attempt resumes from step 6."""
    release = tmp_path / "release-write"
    env = dict(python_env, **{PAUSE_VAR: f"written:6:{release}"})
    proc = subprocess.Popen(_command("--run-id", "r", "--max-restarts", "1", "--grace-period", "2", "--spares", "0"), cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "r"
    try:
        assert wait_for(lambda: "checkpoint save paused at written (step 6)" in _worker_log(run_dir, 0), timeout=240)
        victim = worker_of(proc.pid, 1)
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        supervisor_log = run_dir / "supervisor.log"
        assert wait_for(lambda: "still writing a checkpoint in the background: waiting for it"
                        in supervisor_log.read_text(errors="replace"), timeout=60)
    finally:
        release.touch()
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert "CPU0 still writing a checkpoint in the background: waiting for it" in err
    assert "the checkpoint of step 6 being written in the background" in _worker_log(run_dir, 0)
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    first, second = summary["attempts"]
    assert first["root_cause"]["rank"] == 1
    assert second["resumed_from"] == str(tmp_path / ".checkpoints" / "step_0000006.pt")
    assert "at step 6" in _worker_log(run_dir, 0, attempt=1)


def test_sigterm_while_a_background_write_cannot_finish_leaves_the_previous_checkpoint(tmp_path, python_env):
    """Rank 0's write of step 6 never gets past its manifest: the stop timeout runs out, the run
    says the final checkpoint was NOT saved (exit 1), and --resume auto takes step 3."""
    env = dict(python_env, **{PAUSE_VAR: "manifest:6"})
    proc = subprocess.Popen(_command("--run-id", "r", "--stop-timeout", "6"), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "r"
    try:
        assert wait_for(lambda: "checkpoint save paused at manifest (step 6)" in _worker_log(run_dir, 0), timeout=240)
        proc.send_signal(signal.SIGTERM)
    finally:
        code, _out, err = finish(proc, timeout=240)
    assert code == 1, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["final_save"] == "not saved"
    assert "was killed while saving it" in summary["root_cause"]["message"]
    ckpt = tmp_path / ".checkpoints"
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == ["step_0000003.pt"]  # keep_last=1 kept it

    resumed = subprocess.run(_command("--run-id", "again", "--resume", "auto"), cwd=tmp_path, env=python_env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt / 'step_0000003.pt'} at step 3" in resumed.stderr


@pytest.mark.slow
def test_a_stuck_checkpoint_writer_is_named_not_blamed_on_a_rank_and_killed_with_its_rank(tmp_path, python_env):
    """Rank 0's forked writer of step 3 never finishes: at the next save rank 0 waits for it and
    rank 1 waits in the state capture's collective for rank 0. The hang verdict names the
    writer (its pid, the checkpoint, how long), not rank 1; the teardown kills the writer with
    rank 0 instead of waiting the stop timeout for it."""
    env = dict(python_env, **{PAUSE_VAR: "staged:3"})
    # the checkpoint phase's allowance, before one was learned, is the startup allowance
    cmd = _command("--run-id", "w", "--hang-timeout", "6") + ["--set", "training.max_steps=40",
                                                              "--set", "system.startup_timeout=30"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "w"
    try:
        assert wait_for(lambda: "checkpoint save paused at staged (step 3)" in _worker_log(run_dir, 0), timeout=240)
        log = _worker_log(run_dir, 0)
        writer = int(log.split("checkpoint save paused at staged (step 3)")[1].split("pid ")[1].split("]")[0])
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 124, err[-3000:]
    cause = orjson.loads((run_dir / "summary.json").read_bytes())["root_cause"]
    said = " ".join([cause["message"], *cause.get("evidence", [])])
    assert cause["rank"] == 0, said
    assert f"checkpoint writer (pid {writer}) writing" in said and "(step 3)" in said, said
    assert "still writing a checkpoint in the background: waiting" not in err  # no stop timeout waited out
    assert not psutil.pid_exists(writer) or psutil.Process(writer).status() == psutil.STATUS_ZOMBIE
