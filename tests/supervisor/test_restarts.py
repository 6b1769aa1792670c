"""`--max-restarts`: which failures restart, per-attempt logs and summary, the pause between attempts."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import orjson
import psutil
import pytest

from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import from_object as rec
from supervisor.restarts import (STREAK_RESET_S, RestartPlan, RunCheckpoints, held_stop_signals, pause, plan_restart,
                                 refusal)
from supervisor.summary import RootCause
from tests.supervisor.helpers import finish, run, start, wait_for

FAST = ("--restart-backoff", "0.2", "--grace-period", "2")


def test_failed_attempt_is_restarted_and_the_run_succeeds(tmp_path):
    r = run(tmp_path, "train:3", "fail-until:1", args=("--max-restarts", "2", *FAST))
    assert r.code == 0, r.err[-3000:]
    s = r.summary
    assert s["restarts"] == 1 and s["max_restarts"] == 2 and s["exit_code"] == 0
    first, second = s["attempts"]
    assert first["exit_code"] == 1 and first["root_cause"]["rank"] == 1
    assert "boom on attempt 0" in " ".join(first["root_cause"]["stderr_tail"])
    assert second["outcome"] == "success" and second["resumed_from"] is None
    # the first attempt's logs stay where they were; the second's are beside them
    assert "boom on attempt 0" in (r.run_dir / "worker-rank1-CPU1.log").read_text()
    assert "attempt 1" in (r.run_dir / "attempt-1" / "worker-rank1-CPU1.log").read_text()
    assert second["log_dir"] == str(r.run_dir / "attempt-1")
    assert "restart 1 of 2" in r.err and "after 1 restart(s)" in r.err
    assert "attempt 0 failed with exit code 1" in r.err


def test_restarts_stop_when_used_up_with_the_last_cause(tmp_path):
    r = run(tmp_path, "train:3", "fail-until:9", args=("--max-restarts", "2", *FAST))
    assert r.code == 1
    s = r.summary
    assert [a["attempt"] for a in s["attempts"]] == [0, 1, 2]
    assert "boom on attempt 2" in s["root_cause"]["message"] or "boom on attempt 2" in " ".join(
        s["root_cause"]["stderr_tail"])
    assert s["attempts"][-1]["not_restarted"] == "all 2 restart(s) used"
    assert "not restarted: all 2 restart(s) used" in r.err


@pytest.mark.parametrize("code", [2, 3, 6])
def test_a_scripts_own_exit_codes_are_restarted_like_any_crash(tmp_path, code):
    """gpuherd's meanings of 2/3/6 (config, dataset, NaN: never restarted) are the built-in trainer's."""
    r = run(tmp_path, "train:3", f"exit:{code}", args=("--max-restarts", "1", *FAST))
    assert r.code == code
    s = r.summary
    assert len(s["attempts"]) == 2 and s["attempts"][-1]["not_restarted"] == "all 1 restart(s) used"
    assert s["root_cause"]["message"].startswith(f"CPU1 (rank 1) exit code {code} after")
    assert f"FAILED with exit code {code}\n" in r.err


def test_a_cancelled_job_is_not_restarted_whoever_saw_sigterm_first(tmp_path):
    """scancel / a time limit: SIGTERM reaches the workers and the supervisor in either order."""
    r = run(tmp_path, "forever", "scancel", args=("--max-restarts", "3", *FAST))
    assert r.code == 143, r.err[-2000:]
    attempts = r.summary["attempts"]
    assert len(attempts) == 1 and attempts[0]["stop_signal"] == "SIGTERM"
    assert "SIGTERM" in attempts[0]["not_restarted"] or "asked to stop" in attempts[0]["not_restarted"]




def test_without_restarts_the_summary_has_one_attempt_and_no_restart_lines(tmp_path):
    r = run(tmp_path, "train:3", "raise")
    assert r.code == 1
    assert len(r.summary["attempts"]) == 1 and r.summary["attempts"][0]["not_restarted"] is None
    assert "not restarted" not in r.err and "attempt 0" not in r.err


def test_ctrl_c_during_the_pause_ends_the_run_with_130(tmp_path):
    proc = start(tmp_path, "train:3", "fail-until:9", args=("--max-restarts", "3", "--restart-backoff", "60"))
    seen = []

    def read_stderr() -> None:
        for line in proc.stderr:
            seen.append(line)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    assert wait_for(lambda: any("restart 1 of 3" in line for line in seen), timeout=60)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == ExitCode.SIGINT
    assert time.monotonic() - t0 < 5
    reader.join(timeout=5)
    finish(proc)
    assert any("interrupted by Ctrl-C (SIGINT) during the pause before attempt 1" in line for line in seen)


def test_refusal_policy():
    assert refusal(RootCause("worker-exit", 1, "x"), False) is None
    assert refusal(RootCause("hang", 124, "x"), False) is None
    assert refusal(RootCause("worker-exit", 137, "x"), False) is None
    assert refusal(RootCause("watcher", 4, "gpu-xid"), False) is None
    assert "asked to stop" in refusal(RootCause("interrupted", 130, "x"), False)
    assert "asked to stop" in refusal(RootCause("terminated", 143, "x"), False)
    assert refusal(RootCause("worker-exit", 6, "x"), True) is None
    assert "--restart-on-nan" in refusal(RootCause("worker-exit", 6, "x"), False)
    assert "config error" in refusal(RootCause("worker-exit", 2, "x"), False)
    assert "dataset error" in refusal(RootCause("worker-exit", 3, "x"), False)
    for code in (2, 3, 6):  # a user script's own codes: restarted like any crash
        assert refusal(RootCause("worker-exit", code, "x", script_code=True), False) is None
    assert "asked to stop" in refusal(RootCause("interrupted", 130, "x", script_code=True), False)
    assert "disk" in refusal(RootCause("worker-exit", ExitCode.STORAGE, "x"), True)
    assert "reproduced" in refusal(RootCause("worker-exit", ExitCode.DATA_MODEL, "x"), True)
    assert refusal(RootCause("worker-exit", ExitCode.DEVICE_SUSPECT, "x"), False) is None  # another attempt may do


def _plan(cause: RootCause, *, attempt: int = 0, max_restarts: int = 3, train: bool = True, stop: str | None = None,
          streak: int = 0, ran_s: float = 5.0, progressed: bool = False) -> RestartPlan:
    return plan_restart(cause, stop_signal=stop, attempt=attempt, max_restarts=max_restarts, train=train,
                        restart_on_nan=False, base_backoff=0.2, streak=streak, ran_s=ran_s, progressed=progressed)


CRASH = RootCause("worker-exit", 1, "CPU1 (rank 1) exit code 1")


def test_the_restart_policy_restarts_a_crash_after_a_doubling_pause():
    first = _plan(CRASH)
    assert first == RestartPlan(None, check_dataset=True, delay=0.2, streak=1)  # the built-in trainer: cache first
    assert _plan(CRASH, streak=first.streak) == RestartPlan(None, check_dataset=True, delay=0.4, streak=2)
    assert _plan(CRASH, streak=3, ran_s=STREAK_RESET_S) == RestartPlan(None, check_dataset=True, delay=0.2, streak=1)
    # an attempt that completed a step was not failing quickly, however short it was
    assert _plan(CRASH, streak=3, ran_s=15.0, progressed=True) == RestartPlan(None, check_dataset=True, delay=0.2,
                                                                             streak=1)
    assert _plan(CRASH, streak=20).delay == 60.0  # capped
    assert _plan(CRASH, train=False) == RestartPlan(None, delay=0.2, streak=1)  # a script: no cache to check


def test_the_restart_policy_ends_the_run_when_restarts_are_used_up_or_the_cause_would_repeat():
    assert _plan(CRASH, attempt=3).why_not == "all 3 restart(s) used"
    assert _plan(RootCause("worker-exit", 2, "x"), attempt=3).why_not.startswith("a usage or config error")
    assert _plan(RootCause("worker-exit", 2, "x")) == RestartPlan(
        "a usage or config error fails every attempt the same way", streak=0)
    assert _plan(RootCause("interrupted", 130, "x")).why_not == "the run was asked to stop"


def test_a_stop_signal_during_the_attempt_is_never_restarted_whatever_the_workers_codes():
    plan = _plan(RootCause("worker-exit", 143, "CPU0 (rank 0) killed by SIGTERM"), stop="SIGTERM")
    assert plan == RestartPlan("the supervisor received SIGTERM", streak=0)


def test_a_dataset_error_is_restarted_only_once_the_cache_is_rebuilt():
    plan = _plan(RootCause("worker-exit", 3, "x"))
    assert plan.check_dataset and plan.why_not == "a dataset error fails every attempt the same way"
    assert _plan(RootCause("worker-exit", 3, "x"), train=False).check_dataset is False


def test_a_membership_change_restarts_at_once_uncounted_even_with_no_restarts_left():
    """Elastic (--nnodes MIN:MAX): a node asking to join ends the attempt; torchrun does not
    count that restart, and neither does gpuherd. A stop request during it still ends the run."""
    joining = RootCause("membership", 0, "node 2 (h2) asks to join")
    assert _plan(joining, attempt=3, max_restarts=3, streak=2) == RestartPlan(None, streak=2, counted=False)
    assert _plan(joining, max_restarts=0).why_not is None
    assert _plan(joining, stop="SIGTERM") == RestartPlan("the supervisor received SIGTERM", counted=False)
    assert _plan(CRASH).counted


def _saved(path, step: int, rank: int = 0) -> dict:
    return rec({"type": "checkpoint", "rank": rank, "time": 0.0, "step": step, "path": str(path)})


def _rewrite(path, data: bytes) -> None:
    """What a saver does: a new file renamed over the name (a new inode)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_checkpoints_come_from_this_runs_own_reports(tmp_path):
    (tmp_path / "step_0000009.pt").write_bytes(b"another run's, newer than ours")
    watch = RunCheckpoints()
    assert watch.newest_of_this_run() is None
    ours = tmp_path / "step_0000002.pt"
    ours.write_bytes(b"ours")
    watch.observe(_saved(ours, 2))
    watch.observe(_saved(ours, 2, rank=1))  # every rank reports the save rank 0 wrote
    watch.observe(rec({"type": "step", "rank": 0, "step": 3, "path": str(tmp_path / "step_0000009.pt")}))
    watch.observe(_saved(tmp_path / "step_0000003", 3))  # a directory without meta.pt: never complete
    assert watch.newest_of_this_run() == ours
    sharded = tmp_path / "step_0000004"
    sharded.mkdir()
    (sharded / "meta.pt").write_bytes(b"ours, sharded")
    watch.observe(_saved(sharded, 4))
    assert watch.newest_of_this_run() == sharded
    _rewrite(sharded / "meta.pt", b"another run saved step 4 into the shared directory")
    assert watch.newest_of_this_run() == ours


def test_a_late_report_does_not_adopt_another_runs_file(tmp_path):
    path = tmp_path / "step_0000005.pt"
    path.write_bytes(b"ours")
    watch = RunCheckpoints()
    watch.observe(_saved(path, 5, rank=0))
    _rewrite(path, b"another run's step 5")
    watch.observe(_saved(path, 5, rank=1))  # rank 1's report of the same save comes after the overwrite
    assert watch.newest_of_this_run() is None
    _rewrite(path, b"ours again: rank 0 saved step 5 once more (a final save at a stop)")
    watch.observe(_saved(path, 5, rank=0))
    assert watch.newest_of_this_run() == path
    path.unlink()  # pruned by training.keep_last
    assert watch.newest_of_this_run() is None


def test_a_stop_signal_another_thread_takes_still_ends_the_pause():
    """The supervisor has threads of its own (console pumps, imports); a signal the kernel hands
    to one of them must end the pause all the same."""
    stop = threading.Event()
    taker = threading.Thread(target=stop.wait, args=(10,), daemon=True)  # SIGTERM deliverable to it
    taker.start()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # so the kernel picks the taker
    try:
        timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
        timer.start()
        t0 = time.monotonic()
        assert pause(30) == signal.SIGTERM
        assert time.monotonic() - t0 < 5
    finally:
        stop.set()
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def test_pause_returns_early_on_a_stop_signal():
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    timer.start()
    assert pause(30) == signal.SIGTERM
    assert time.monotonic() - t0 < 5
    assert pause(0.05) is None
    assert signal.getsignal(signal.SIGTERM) is not None


def test_a_ctrl_c_after_the_restart_is_announced_is_the_pauses_however_long_the_bookkeeping_takes():
    """Between "restart 1 of 3 in 60 s" and the wait itself come the metrics record and the goodput
    account; a Ctrl-C there must end the pause, not raise in the middle of them."""
    with held_stop_signals() as held:
        os.kill(os.getpid(), signal.SIGINT)  # arrives during the bookkeeping
        time.sleep(0.2)
        t0 = time.monotonic()
        assert pause(30, held=held) == signal.SIGINT
    assert time.monotonic() - t0 < 5
    assert pause(0.05) is None  # consumed: nothing left pending


def test_the_job_holds_stop_signals_from_its_restart_announcement_on(monkeypatch):
    from supervisor.job import Job

    class Announcing:
        def _announce_and_pause(self, *args) -> int | None:
            held = args[-1]
            os.kill(os.getpid(), signal.SIGINT)  # as if between the restart line and the wait
            time.sleep(0.2)
            return pause(30, held=held)

    assert Job._restart(Announcing(), None, None, None, 0.0) == signal.SIGINT


def test_the_backoff_counts_from_the_attempts_end_not_after_the_work_between_attempts():
    t0 = time.monotonic()
    assert pause(30, since=t0 - 30) is None  # the dataset check and the bookkeeping took the whole backoff
    assert time.monotonic() - t0 < 1
    t0 = time.monotonic()
    assert pause(0.3, since=t0 - 0.1) is None
    assert 0.15 <= time.monotonic() - t0 < 5


def test_restarted_attempt_env(tmp_path: Path):
    from supervisor.gpus.devices import DevicePlan, DeviceSlot
    from supervisor.processes.worker_env import RunEnv, worker_env

    plan = DevicePlan(slots=(DeviceSlot(0, "cpu", 0),), isolate=False)
    run_env = RunEnv(run_id="r", run_dir=str(tmp_path), master_addr="127.0.0.1", master_port=1, supervisor_pid=1,
                     restart_count=2, max_restarts=3, resume="/ck/step_0000004.pt")
    env = worker_env({"GPUHERD_RESUME": "stale"}, plan, plan.slots[0], run_env, 5)
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    assert env["GPUHERD_RESUME"] == "/ck/step_0000004.pt"
    first = RunEnv(run_id="r", run_dir=str(tmp_path), master_addr="127.0.0.1", master_port=1, supervisor_pid=1)
    assert "GPUHERD_RESUME" not in worker_env({"GPUHERD_RESUME": "stale"}, plan, plan.slots[0], first, 5)


@pytest.mark.parametrize("other_step", [4, 2])
def test_a_restart_never_resumes_from_another_runs_checkpoint(tmp_path, other_step):
    """Two runs share .checkpoints/. Run A saves step 2; run B then saves a newer step 4, or
    step 2 again over A's file; then A fails. A's restart resumes from its own step 2, or,
    its file being B's now, starts afresh — never from B's weights."""
    a = start(tmp_path, "save-then-fail:2", args=("--nproc", "1", "--run-id", "a", "--max-restarts", "1", *FAST))
    a_log = tmp_path / "logs" / "a" / "worker-rank0-CPU0.log"
    try:
        assert wait_for(lambda: a_log.exists() and "saved " in a_log.read_text(), timeout=60)
        b = run(tmp_path, f"save:{other_step}", args=("--nproc", "1", "--run-id", "b"))
        assert b.code == 0, b.err[-3000:]
        (tmp_path / "go").touch()
    finally:
        code, _, err = finish(a, timeout=120)
    assert code == 0, err[-3000:]
    attempts = orjson.loads((tmp_path / "logs" / "a" / "summary.json").read_bytes())["attempts"]
    ours = tmp_path / ".checkpoints" / "step_0000002.pt"
    expected = str(ours) if other_step != 2 else None
    assert attempts[1]["resumed_from"] == expected
    resumed = (tmp_path / "logs" / "a" / "attempt-1" / "worker-rank0-CPU0.log").read_text()
    assert f"resume={expected or ''!r}" in resumed


# Says whether torch was imported before it started and steps an optimizer (the attempt's first
# step starts the standbys); rank 1 then fails on the first attempt.
PRELOADED = """\
import os, sys, time
print(f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {os.environ['RANK']} torch preloaded: "
      f"{'torch' in sys.modules} standby marker: {os.environ.get('GPUHERD_STANDBY')}", flush=True)
import torch
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).step()
time.sleep(1.0)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    raise SystemExit(1)
"""


def test_a_scripts_restart_starts_from_standbys_that_imported_torch_while_it_trained(tmp_path):
    script = tmp_path / "preloaded.py"
    script.write_text(PRELOADED)
    r = run(tmp_path, args=("--nproc", "2", "--max-restarts", "1", *FAST), script=script, timeout=120)
    assert r.code == 0, r.err[-3000:]
    for rank in (0, 1):
        assert f"restart 0 rank {rank} torch preloaded: False standby marker: None" in r.out
        assert f"restart 1 rank {rank} torch preloaded: True standby marker: None" in r.out
    assert r.summary["restarts"] == 1
    # the last attempt had no restart left: it started no standby, and the first one's were used
    assert not any("preloaded.py" in " ".join(p.cmdline()) for p in psutil.Process().children(recursive=True))
