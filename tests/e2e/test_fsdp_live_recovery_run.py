"""Live recovery of sharded state through the whole product: an FSDP2 run on 3 CPU ranks loses one
at a random step (SIGKILL); a warm spare takes its shard from the neighbour's copy, the other two
keep their processes and return to the copy's step, nobody restarts, no checkpoint is read, at
most one step is trained again, every loss equals an uninterrupted FSDP run's, bit for bit, and
no periodic save is lost (one the loss cut short is written again)."""

from __future__ import annotations

import random
import signal
import subprocess

import orjson
import psutil

from tests.e2e.helpers import records
from tests.e2e.helpers import next_spare
from tests.e2e.test_live_recovery_run import _command, _losses, _pid, _reached, _same_losses
from tests.supervisor.helpers import finish, wait_for

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
    assert {r["step"] for r in records(run_dir, "checkpoint")} == {5, 10, 15, STEPS}, where
    _same_losses(_losses(run_dir), expected, lost, rec["resumed_step"])
