"""Issue 9's restart promise through the whole product: a worker killed mid-run is
restarted, resumes from the newest checkpoint this run wrote, and the run ends with
the same final loss, bit for bit, as a run that was never interrupted; a dataset cache
deleted meanwhile is rebuilt before the restart. The uninterrupted run's async saves are
also where the trainer's account of what a save cost is checked against its step records."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import orjson

from bench.save_loss import save_losses
from tests.e2e.helpers import records
from tests.supervisor.helpers import finish, wait_for, worker_of

# A checkpoint every 20 steps: the kill comes after step 40's, 80 steps before the end (the test says
# so if the run ever ends first); the uninterrupted run's 5 async saves are the account's sample.
STEPS = 120
TINY = [
    "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
    "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.grad_accum_nums=1", f"training.max_steps={STEPS}", "training.warmup_steps=5", "training.log_every=1",
    "training.eval_every=0", "training.save_every=20", "training.keep_last=2",
]


def _command(*extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", "--nproc", "2", *extra]
    for item in TINY:
        cmd += ["--set", item]
    return cmd


def _final_losses(run_dir) -> dict[int, float]:
    return {r["rank"]: r["loss"] for r in records(run_dir, "step") if r["step"] == STEPS - 1 and "loss" in r}


def _the_trainers_account_is_what_its_records_show(run_dir) -> None:
    """Rank 0's own account of each periodic (async) save (its `accounted` records, measured on
    its clock: worker/save_cost.py) against the same loss read off its step records."""
    kinds = ("step", "phase", "checkpoint", "checkpoint_write")
    rows = save_losses([r for kind in kinds for r in records(run_dir, kind)])["saves"]
    assert [row["step"] for row in rows] == list(range(20, STEPS, 20))
    assert all(row["trainer_s"] is not None for row in rows)
    assert {r["mode"] for r in records(run_dir, "checkpoint") if r["step"] < STEPS} == {"async"}
    trainer, read = sum(row["trainer_s"] for row in rows), sum(row["records_s"] for row in rows)
    # the same windows and typical step by construction; 10% (2 ms a save where the sum is near
    # zero) is room for a step that ends between a write's record and the loop seeing it ended
    assert abs(trainer - read) <= max(0.1 * abs(read), 0.002 * len(rows)), rows


def test_killed_worker_is_restarted_and_the_final_loss_is_bit_identical(tmp_path, python_env):
    plain_dir, restart_dir = tmp_path / "plain", tmp_path / "restarted"
    plain_dir.mkdir()
    restart_dir.mkdir()
    # the uninterrupted run beside the restarted one (each mostly waits on its own processes)
    plain = subprocess.Popen(_command("--run-id", "plain"), cwd=plain_dir, env=python_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _killed_and_restarted(restart_dir, python_env)
    finally:
        plain_code, _out, plain_err = finish(plain, timeout=300)
    assert plain_code == 0, plain_err[-3000:]
    expected = _final_losses(plain_dir / "logs" / "plain")
    assert set(expected) == {0, 1}
    _the_trainers_account_is_what_its_records_show(plain_dir / "logs" / "plain")
    assert _final_losses(restart_dir / "logs" / "r") == expected  # float equality: bit for bit


def _killed_and_restarted(restart_dir, python_env) -> None:
    """Rank 1 SIGKILLed after the checkpoint of step 40, its dataset cache deleted just before (a
    cleanup job, a full disk's victim): the restart would fail on the missing cache (exit 3), so the
    supervisor rebuilds it first, under the same lock; one restart, resumed from that checkpoint."""
    proc = subprocess.Popen(_command("--run-id", "r", "--max-restarts", "2", "--restart-backoff", "0.5", "--spares", "0"),
                            cwd=restart_dir, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = restart_dir / "logs" / "r"
    try:
        assert wait_for(lambda: any(r["step"] >= 40 for r in records(run_dir, "checkpoint")), timeout=240, interval=0.02)
        caches = [p for p in (restart_dir / "cache" / "datasets").iterdir() if not p.name.startswith(".")]
        assert len(caches) == 1
        shutil.rmtree(caches[0])
        victim = worker_of(proc.pid, 1)
        assert victim is not None
        killed_after = max(r["step"] for r in records(run_dir, "step"))
        victim.send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    assert killed_after < STEPS - 1, "the run finished before the kill: make it longer"

    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 1
    first, second = summary["attempts"]
    assert first["exit_code"] == 128 + signal.SIGKILL and first["root_cause"]["rank"] == 1
    assert second["outcome"] == "success"
    assert f"dataset cache rebuilt: {caches[0]}" in err
    assert (caches[0] / "metadata.json").is_file()
    resumed = second["resumed_from"]
    assert resumed is not None and resumed.startswith(str(restart_dir / ".checkpoints" / "step_"))
    resumed_step = int(resumed.rsplit("_", 1)[1].removesuffix(".pt"))
    assert 40 <= resumed_step <= killed_after + 1
    assert f"resumed from {resumed} at step {resumed_step}" in (run_dir / "attempt-1" / "worker-rank0-CPU0.log").read_text()


def test_run_training_resume_flag_continues_from_the_latest_checkpoint(tmp_path, python_env):
    """`run_training.sh --resume auto` (= --set training.resume=auto), as in pretrain_main.py."""
    def train(max_steps: int, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", "--nproc", "2", *extra]
        for item in TINY:
            cmd += ["--set", item]
        cmd += ["--set", f"training.max_steps={max_steps}", "--set", "training.save_every=3"]
        return subprocess.run(cmd, cwd=tmp_path, env=python_env, capture_output=True, text=True, timeout=300)

    first = train(6, "--run-id", "first")
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(8, "--run-id", "second", "--resume", "auto")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {tmp_path / '.checkpoints' / 'step_0000006.pt'} at step 6" in second.stderr
    steps = sorted({r["step"] for r in records(tmp_path / "logs" / "second", "step") if "loss" in r})
    assert steps == [6, 7]
