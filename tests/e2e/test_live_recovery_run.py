"""Live recovery through the whole product: a rank lost mid-run (killed at a random step, or
hung and killed after the verdict) is replaced by a warm spare while the other rank keeps its
process, no checkpoint is read, and every loss of the run equals an uninterrupted run's, bit
for bit; a second failure during the recovery falls back to a restart, said in one line."""

from __future__ import annotations

import contextlib

import random
import signal
import subprocess
import time
import sys
from pathlib import Path

import orjson
import psutil
import pytest

from tests.e2e.helpers import cut_short, forked_spares, next_spare, records
from tests.shared_runs import once_per_session
from tests.supervisor.helpers import finish, wait_for
from worker.save_phases import PAUSE_VAR

STEPS = 40
TINY = [
    "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
    "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.grad_accum_nums=1", f"training.max_steps={STEPS}", "training.warmup_steps=5", "training.log_every=1",
    "training.eval_every=0", "training.save_every=0",
]


def _command(run_id: str, *extra: str, nproc: int = 2, steps: int = STEPS) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", "--nproc", str(nproc),
           "--run-id", run_id, *extra]
    for item in TINY:
        cmd += ["--set", item]
    return cmd + ["--set", f"training.max_steps={steps}"]


def _losses(run_dir) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss; a step done twice counts with its last value."""
    return {(r["rank"], r["step"]): r["loss"] for r in records(run_dir, "step") if "loss" in r}


def _same_losses(got: dict[tuple[int, int], float], expected: dict[tuple[int, int], float], lost_rank: int,
                 resumed: int, run_dir=None) -> None:
    """Every loss logged equals the uninterrupted run's (float equality: bit for bit). Only the step
    before the one the group resumed at may lack a loss: the lost rank's, when it finished the step
    but died before logging it (the survivors had it), and, with `run_dir`, a survivor's that was
    still in that step's all-reduce when the peer died while others completed it (gloo's ring
    hands the sum to some ranks first; its `lost_peer` record says so: `step` = completed steps)."""
    assert {key: expected[key] for key in got} == got
    behind = cut_short([run_dir], resumed) if run_dir is not None else set()
    assert {key for key in expected if key not in got} <= {(rank, resumed - 1) for rank in {lost_rank, *behind}}


def _pid(run_dir, rank: int) -> int:
    return [r["pid"] for r in records(run_dir, "ready") if r["rank"] == rank][0]


def handed_to_spare(run_dir) -> bool:
    """The supervisor has handed the first lost rank to a warm spare (its line is in the log)."""
    return "live recovery 1: warm spare" in (run_dir / "supervisor.log").read_text(errors="replace")


def _reached(run_dir, step: int) -> bool:
    return any(r["step"] >= step for r in records(run_dir, "step"))


PLAIN_RUNS: dict[int, Path] = {}  # ranks -> one uninterrupted run's directory (its other records)


def _uninterrupted(tmp_path_factory, python_env, nproc: int) -> dict[tuple[int, int], float]:
    """One uninterrupted run per rank count for the whole session (tests/e2e/test_shrink_run.py's
    too, often on another xdist worker)."""

    def make(cwd: Path) -> Path:
        run = subprocess.run(_command("plain", nproc=nproc), cwd=cwd, env=python_env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return cwd / "logs" / "plain"

    PLAIN_RUNS[nproc] = once_per_session(tmp_path_factory, f"uninterrupted-{nproc}-ranks", make)
    losses = _losses(PLAIN_RUNS[nproc])
    assert len(losses) == nproc * STEPS
    return losses


@pytest.fixture
def uninterrupted(tmp_path_factory, python_env) -> dict[tuple[int, int], float]:
    return _uninterrupted(tmp_path_factory, python_env, 2)


def test_a_rank_killed_at_a_random_step_is_replaced_live_with_bit_identical_losses(tmp_path, python_env,
                                                                                    uninterrupted):
    kill_at = random.randint(3, STEPS - 10)
    proc = subprocess.Popen(_command("r", "--max-restarts", "1"), cwd=tmp_path, env=python_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "r"
    try:
        assert wait_for(lambda: _reached(run_dir, kill_at), timeout=240, interval=0.02)
        survivor, victim = _pid(run_dir, 0), _pid(run_dir, 1)
        spare = next_spare(proc.pid).pid
        psutil.Process(victim).send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]

    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1  # nobody restarted
    (rec,) = summary["recoveries"]
    assert rec["outcome"] == "recovered" and rec["rank"] == 1 and rec["lost_pid"] == victim
    assert rec["replaced_by_pid"] == spare and rec["survivors"] == [{"rank": 0, "pid": survivor}]
    assert rec["steps_redone"] <= 1 and rec["checkpoint_reads"] == 0 and rec["seconds"] > 0
    assert {w["rank"]: w["pid"] for w in summary["workers"]} == {0: survivor, 1: spare}  # rank 0 kept its pid
    assert "resumed from" not in err and "live recovery 1: rank 1 (CPU1" in err
    _same_losses(_losses(run_dir), uninterrupted, 1, rec["resumed_step"], run_dir)


def test_with_four_ranks_any_lost_rank_is_replaced_live_while_the_other_three_keep_training(
        tmp_path, tmp_path_factory, python_env):
    """With more than two ranks a survivor can wait in a collective on another survivor instead of
    the lost rank, and gloo gives it no error there: the recovery holds only if the survivors that
    did see the loss free it (their connections shut down), whichever rank was lost."""
    expected = _uninterrupted(tmp_path_factory, python_env, 4)
    kill_at, lost = random.randint(3, STEPS - 10), random.randrange(4)
    proc = subprocess.Popen(_command("r4", "--max-restarts", "1", nproc=4), cwd=tmp_path, env=python_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "r4"
    try:
        assert wait_for(lambda: _reached(run_dir, kill_at), timeout=240, interval=0.02)
        pids = {rank: _pid(run_dir, rank) for rank in range(4)}
        spare = next_spare(proc.pid).pid
        psutil.Process(pids[lost]).send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, f"rank {lost} killed at step {kill_at}: {err[-3000:]}"
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, _why_not_live(run_dir, summary, lost, kill_at)
    (rec,) = summary["recoveries"]
    assert rec["outcome"] == "recovered" and rec["rank"] == lost and rec["replaced_by_pid"] == spare
    survivors = {rank: pid for rank, pid in pids.items() if rank != lost}
    assert rec["survivors"] == [{"rank": rank, "pid": pid} for rank, pid in survivors.items()]
    assert rec["steps_redone"] <= 1 and rec["checkpoint_reads"] == 0
    assert {w["rank"]: w["pid"] for w in summary["workers"]} == {**survivors, lost: spare}
    _same_losses(_losses(run_dir), expected, lost, rec["resumed_step"], run_dir)


def _why_not_live(run_dir: Path, summary: dict, lost: int, kill_at: int) -> str:
    """Where a recovery that ended in a restart went wrong: the first attempt's cause and every
    worker log's tail (the stacks a stuck verdict asks for land there)."""
    tails = "\n".join(f"--- {log.name}\n" + "".join(log.read_text(errors="replace").splitlines(True)[-40:])
                      for log in sorted(run_dir.glob("worker-rank*.log")))
    return (f"rank {lost} killed at step {kill_at}; attempt 0 ended: "
            f"{summary['attempts'][0].get('root_cause')}\n{tails[-12000:]}")


def _spare_other_than(supervisor_pid: int, used: set[int]) -> psutil.Process | None:
    """A warm spare forked and not promoted yet (a promoted one keeps GPUHERD_SPARE=1 in its initial
    environment)."""
    return next((p for p in forked_spares(supervisor_pid) if p.pid not in used), None)


def test_with_the_defaults_four_kills_in_a_row_are_all_recovered_live_as_the_spare_pool_refills(tmp_path, python_env):
    """One warm spare and --max-restarts 8 (the defaults): each recovery forks a new spare from the
    pool's spare source, so the second, third and fourth kill find one standing by too; nobody restarts."""
    proc = subprocess.Popen(_command("k4", "--max-restarts", "8", steps=100000), cwd=tmp_path,
                            env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "k4"
    victims, spares = [], set()
    try:
        assert wait_for(lambda: _reached(run_dir, 3), timeout=240, interval=0.02)
        victim = _pid(run_dir, 1)
        for kill in range(1, 5):
            found: list[psutil.Process] = []
            assert wait_for(lambda: found.append(_spare_other_than(proc.pid, spares)) or found[-1] is not None,
                            timeout=240, interval=0.05), f"no new warm spare before kill {kill}"
            spares.add(found[-1].pid)
            psutil.Process(victim).send_signal(signal.SIGKILL)
            victims.append(victim)
            assert wait_for(lambda: len([r for r in records(run_dir, "recovery") if r["outcome"] == "recovered"])
                            == kill, timeout=120, interval=0.05), f"kill {kill} not recovered live"
            victim = records(run_dir, "recovery")[-1]["replaced_by_pid"]
        proc.send_signal(signal.SIGINT)  # enough: a graceful end
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 130, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, err[-3000:]
    recs = summary["recoveries"]
    assert [r["outcome"] for r in recs] == ["recovered"] * 4 and [r["lost_pid"] for r in recs] == victims
    assert {r["replaced_by_pid"] for r in recs} == spares
    assert "live recovery not possible" not in err and err.count("the pool of --spares refills") == 4


@pytest.mark.slow
def test_a_hung_rank_is_killed_after_its_verdict_and_replaced_live(tmp_path, python_env, uninterrupted):
    proc = subprocess.Popen(_command("h", "--max-restarts", "1", "--hang-timeout", "8"), cwd=tmp_path,
                            env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "h"
    try:
        assert wait_for(lambda: _reached(run_dir, 10), timeout=240, interval=0.02)
        survivor, victim = _pid(run_dir, 0), _pid(run_dir, 1)
        psutil.Process(victim).send_signal(signal.SIGSTOP)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    (rec,) = orjson.loads((run_dir / "summary.json").read_bytes())["recoveries"]
    assert rec["outcome"] == "recovered" and rec["kind"] == "hang" and rec["lost_pid"] == victim
    assert rec["survivors"] == [{"rank": 0, "pid": survivor}]
    assert "for a live recovery" in err
    _same_losses(_losses(run_dir), uninterrupted, 1, rec["resumed_step"], run_dir)


@pytest.mark.slow
def test_a_second_failure_during_the_recovery_falls_back_to_a_restart_saying_why(tmp_path, python_env,
                                                                                 uninterrupted):
    proc = subprocess.Popen(_command("s", "--max-restarts", "2"), cwd=tmp_path, env=python_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "s"
    try:
        assert wait_for(lambda: _reached(run_dir, 5), timeout=240, interval=0.02)
        spare = next_spare(proc.pid)
        spare.send_signal(signal.SIGSTOP)  # the recovery cannot finish before the survivor dies too
        psutil.Process(_pid(run_dir, 1)).send_signal(signal.SIGKILL)
        assert wait_for(lambda: records(run_dir, "live") and any(
            r.get("event") == "lost_peer" for r in records(run_dir, "live")), timeout=60, interval=0.02)
        # the supervisor has reaped rank 1 and handed its rank to the spare: the recovery is in
        # flight (the survivor's record alone can come before that, and both deaths then reaped together)
        log = run_dir / "supervisor.log"
        assert wait_for(lambda: "takes rank 1" in log.read_text(errors="replace"), timeout=60, interval=0.02)
        psutil.Process(_pid(run_dir, 0)).send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 1
    assert [r["outcome"] for r in summary["recoveries"]] == ["failed"]
    assert "live recovery not possible: a second failure during a recovery (rank 1 was being replaced)" in err
    assert _losses(run_dir) == uninterrupted  # the restart began afresh (no checkpoint yet): the same run


def test_a_script_that_never_calls_gpuherd_live_is_restarted_and_starts_no_spare(tmp_path, python_env):
    """A script is recovered live only through gpuherd.live (tests/e2e/test_script_live_recovery_run.py);
    one that never attaches keeps no spare, and its loss says why it restarts."""
    script = tmp_path / "train.py"
    script.write_text("import os, sys, time\n"
                      "first = os.environ['TORCHELASTIC_RESTART_COUNT'] == '0'\n"
                      "time.sleep(3 if first and os.environ['RANK'] == '0' else 0)  # a survivor when rank 1 fails\n"
                      "sys.exit(3 if os.environ['RANK'] == '1' and first else 0)\n")
    run = subprocess.run([sys.executable, "-m", "supervisor", "--nproc", "2", "--set", "system.device=cpu",
                          "--no-report", "--max-restarts", "1", "--run-id", "script", str(script)],
                         cwd=tmp_path, env=python_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "live recovery off" not in run.stderr
    assert run.stderr.count("live recovery not possible: rank 1's script had not called gpuherd.live.attach") == 1
    summary = orjson.loads((tmp_path / "logs" / "script" / "summary.json").read_bytes())
    assert summary["restarts"] == 1 and summary["recoveries"] == []
    assert not list((tmp_path / "logs" / "script").rglob("spare-*.log"))  # no spare it could never use


def test_an_evaluation_and_a_save_cut_short_by_a_lost_peer_are_done_by_the_rebuilt_group(tmp_path, python_env):
    """A rank lost during step 10's (long) evaluation, with a periodic save due after it too: the
    rebuilt group evaluates step 10 again and writes its checkpoint, and says so."""
    cmd = _command("owed", "--max-restarts", "1")
    for item in ("training.max_steps=20", "training.eval_every=10", "training.eval_steps=400",
                 "training.save_every=10", "training.keep_last=5"):
        cmd += ["--set", item]  # after TINY's: the last one wins
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run_dir = tmp_path / "logs" / "owed"
    try:
        assert wait_for(lambda: {r["rank"] for r in records(run_dir, "step") if r["step"] == 9} == {0, 1},
                        timeout=240, interval=0.02)
        time.sleep(0.2)  # both ranks are evaluating step 10 (400 batches: a second or more)
        victim = psutil.Process(_pid(run_dir, 1))
        victim.send_signal(signal.SIGSTOP)  # rank 0 ends its batches and waits for rank 1 in the loss's all_reduce
        assert not records(run_dir, "eval"), "the evaluation ended before the kill: make it longer"
        time.sleep(2)  # less than the 3 s after which a stopped rank is a hang on evidence
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.send_signal(signal.SIGKILL)
    finally:
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert [r["outcome"] for r in summary["recoveries"]] == ["recovered"] and summary["restarts"] == 0
    assert {r["step"] for r in records(run_dir, "eval")} == {10, 20}
    assert (tmp_path / ".checkpoints" / "step_0000010.pt").is_file()
    assert "the evaluation and the periodic checkpoint of step 10 was cut short by the lost peer" in err


def test_a_periodic_save_cut_short_by_a_lost_peer_is_written_by_the_rebuilt_group(tmp_path, python_env):
    """No evaluation: step 10's periodic save alone is due when rank 1 is lost (both ranks held at
    the save's first phase, rank 1 SIGKILLed there, rank 0 then meets the lost peer in the state
    capture's gather). The rebuilt group writes step 10's checkpoint and says so; before, it went
    on to step 11 and a later restart resumed from step 0 with nothing said."""
    release = tmp_path / "release-save"
    env = dict(python_env, **{PAUSE_VAR: f"staging:10:{release}"})
    cmd = _command("owedsave", "--max-restarts", "1")
    for item in ("training.max_steps=20", "training.save_every=10", "training.keep_last=5"):
        cmd += ["--set", item]  # after TINY's: the last one wins
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "owedsave"

    def paused(rank: int) -> bool:
        logs = list(run_dir.glob(f"worker-rank{rank}-*.log"))
        return bool(logs) and "checkpoint save paused at staging (step 10)" in logs[0].read_text(errors="replace")

    try:
        assert wait_for(lambda: paused(0) and paused(1), timeout=240)
        psutil.Process(_pid(run_dir, 1)).send_signal(signal.SIGKILL)
        # rank 0 is released only once the supervisor has handed rank 1 to the spare
        assert wait_for(lambda: handed_to_spare(run_dir), timeout=60)
    finally:
        release.touch()
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert [r["outcome"] for r in summary["recoveries"]] == ["recovered"] and summary["restarts"] == 0
    assert (tmp_path / ".checkpoints" / "step_0000010.pt").is_file()
    assert {r["step"] for r in records(run_dir, "checkpoint")} >= {10, 20}
    assert "the periodic checkpoint of step 10 was cut short by the lost peer" in err, err[-3000:]
