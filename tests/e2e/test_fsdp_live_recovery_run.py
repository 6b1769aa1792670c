"""Live recovery of sharded state through the whole product: an FSDP2 run on 3 CPU ranks loses one
at a random step (SIGKILL); a warm spare takes its shard from the neighbour's copy, the other two
keep their processes and return to the copy's step, nobody restarts, no checkpoint is read, at
most one step is trained again, every loss equals an uninterrupted FSDP run's, bit for bit, and
no periodic save is lost (one the loss cut short is written again: of its step, or of the step the
rebuilt group went on from when that is later)."""

from __future__ import annotations

import random
import signal
import subprocess

import orjson
import psutil

from tests.e2e.helpers import next_spare, records
from tests.e2e.test_live_recovery_run import _command, _losses, _pid, _reached, _same_losses, handed_to_spare
from tests.supervisor.helpers import finish, wait_for
from worker.save_phases import PAUSE_VAR

STEPS = 20
RANKS = 3  # the copy ring wraps (rank 2 -> rank 0), and the shards are uneven (a 2-layer model's rows over 3)
# periodic saves in the background (DCP, over a group of the saver's that the rebuilt group makes anew)
FSDP = ["--set", "training.strategy=fsdp", "--set", "training.save_every=5", "--set", "training.keep_last=2"]


def _fsdp(run_id: str, *extra: str) -> list[str]:
    return _command(run_id, *extra, nproc=RANKS, steps=STEPS) + FSDP  # after TINY's: the last one wins


def test_a_lost_fsdp_rank_is_recovered_live_from_its_neighbours_copy_of_its_shard(tmp_path, python_env):
    # the uninterrupted run beside the recovered one (its own directory: its own checkpoints)
    (tmp_path / "plain").mkdir()
    plain = subprocess.Popen(_fsdp("plain"), cwd=tmp_path / "plain", env=python_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    kill_at, lost = random.randint(3, STEPS - 8), random.randrange(RANKS)
    proc = subprocess.Popen(_fsdp("r", "--max-restarts", "1"), cwd=tmp_path, env=python_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "r"
    try:
        assert wait_for(lambda: _reached(run_dir, kill_at), timeout=240, interval=0.02)
        pids = {rank: _pid(run_dir, rank) for rank in range(RANKS)}
        spare = next_spare(proc.pid).pid
        psutil.Process(pids[lost]).send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
        plain_code, _out, plain_err = finish(plain, timeout=300)
    assert plain_code == 0, plain_err[-3000:]
    expected = _losses(tmp_path / "plain" / "logs" / "plain")
    assert len(expected) == RANKS * STEPS
    where = f"rank {lost} killed at step {kill_at}"
    assert code == 0, f"{where}: {err[-3000:]}"
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, where  # nobody restarted
    (rec,) = summary["recoveries"]
    survivors = {rank: pid for rank, pid in pids.items() if rank != lost}
    assert rec["outcome"] == "recovered" and rec["rank"] == lost and rec["replaced_by_pid"] == spare, where
    assert rec["survivors"] == [{"rank": rank, "pid": pid} for rank, pid in survivors.items()], where
    assert rec["source_rank"] == (lost + 1) % RANKS, where  # the shard came from the neighbour's copy
    assert rec["steps_redone"] <= 1 and rec["checkpoint_reads"] == 0, where
    assert {w["rank"]: w["pid"] for w in summary["workers"]} == {**survivors, lost: spare}, where
    assert "resumed from" not in err, where
    # a periodic save the loss cut short is written again: of its own step, or, when the rebuilt group
    # went on from a later step (that step's state is gone), of the step it went on from, said so
    resumed = rec["resumed_step"]
    cut = {r["step"] for r in records(run_dir, "checkpoint_write") if r.get("state") == "failed"}
    replaced = {step for step in cut if step < resumed}
    saves = ({5, 10, 15, STEPS} - replaced) | ({resumed} if replaced else set())
    # (a write can end on one survivor and fail on another, where the peer died in DCP's last barrier)
    assert saves <= {r["step"] for r in records(run_dir, "checkpoint")} <= saves | replaced, (where, cut)
    for step in replaced:
        assert (f"the checkpoint of step {step} was cut short by the lost peer and no rank holds that step's "
                f"state any more: the rebuilt group saves step {resumed} in its place now") in err, where
    _same_losses(_losses(run_dir), expected, lost, rec["resumed_step"])


def test_a_save_whose_step_is_gone_when_the_group_is_rebuilt_is_written_at_the_step_it_goes_on_from(
        tmp_path, python_env):
    """Step 5's background write is held (a slow disk) while the loop trains on; a rank is lost at
    step 7: the write, over the broken group, fails, and no rank holds step 5's state any more.
    The rebuilt group saves the step it goes on from in its place, and says so; before, it went on
    with nothing saved until step 10."""
    release = tmp_path / "release-save"
    env = dict(python_env, **{PAUSE_VAR: f"staged:5:{release}"})
    cmd = _command("heldsave", "--max-restarts", "1", nproc=2, steps=12) + FSDP
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "heldsave"
    try:
        assert wait_for(lambda: _reached(run_dir, 7), timeout=240, interval=0.02)
        assert not records(run_dir, "checkpoint"), "step 5's write was not held"
        psutil.Process(_pid(run_dir, 1)).send_signal(signal.SIGKILL)
        # released once the supervisor handed rank 1 to the spare: the write then fails on the broken group
        assert wait_for(lambda: handed_to_spare(run_dir), timeout=60)
    finally:
        release.touch()
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    (rec,) = summary["recoveries"]
    resumed = rec["resumed_step"]
    assert rec["outcome"] == "recovered" and resumed > 5 and summary["restarts"] == 0
    assert {r["step"] for r in records(run_dir, "checkpoint_write") if r.get("state") == "failed"} == {5}
    assert {r["step"] for r in records(run_dir, "checkpoint")} == {resumed, 10, 12}
    assert (f"the checkpoint of step 5 was cut short by the lost peer and no rank holds that step's state any "
            f"more: the rebuilt group saves step {resumed} in its place now") in err, err[-3000:]
