"""A run asked to stop (Ctrl-C, SIGTERM, SIGUSR1/2) loses nothing: workers get to finish
their save, a save cut off anyway is said, and the supervisor's own pauses or a terminal
that stops reading never make it misjudge or stall. Real supervisors, real signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from supervisor.processes import GracefulStop, within_kill_wait
from tests.supervisor import helpers as sh


def _started(proc: subprocess.Popen, tmp_path, n: int = 2) -> None:
    assert sh.wait_for(lambda: sh.workers_started(proc, n, tmp_path, lines=3)), "workers never started"


def _summary(tmp_path) -> dict:
    return sh.Result(0, "", "", sh.run_dir_of(tmp_path)).summary


def _signalled(tmp_path, signum: int, *behaviours: str, args: tuple[str, ...] = ()) -> tuple[int, str, dict]:
    """Start a supervisor, send it `signum` once every worker is up: (exit code, stderr, summary)."""
    proc = sh.start(tmp_path, *behaviours, args=args)
    _started(proc, tmp_path)
    proc.send_signal(signum)
    code, _, err = sh.finish(proc)
    return code, err, _summary(tmp_path)


def test_sigterm_gives_a_script_the_stop_timeout_to_save(tmp_path):
    """A --script gets SIGTERM, as under torchrun, and the whole stop timeout (not the
    grace period) to save before SIGKILL."""
    code, err, summary = _signalled(tmp_path, signal.SIGTERM, "save-on:TERM:2", "save-on:TERM:2",
                                    args=("--grace-period", "0.5", "--stop-timeout", "60"))
    assert code == 143, err[-3000:]
    assert summary["root_cause"]["kind"] == "terminated" and summary["final_save"] == "saved"
    for w in summary["workers"]:
        assert w["exit_code"] == 143 and "SIGKILL" not in w["signals_sent"], w
    assert "SIGTERM to every worker, SIGKILL after 60 s (the stop timeout)" in err


def test_ctrl_c_grace_is_extended_while_a_worker_saves(tmp_path):
    code, err, summary = _signalled(tmp_path, signal.SIGINT, "save-on:INT:2", "save-on:INT:2",
                                    args=("--grace-period", "0.5"))
    assert code == 130, err[-3000:]
    assert summary["final_save"] == "saved"
    assert [w["exit_code"] for w in summary["workers"]] == [130, 130]
    assert all(w["signals_sent"] == ["SIGINT"] for w in summary["workers"])
    assert "still saving a checkpoint: waiting for it" in err
    assert all("checkpoint saved" in sh.Result(0, "", "", sh.run_dir_of(tmp_path)).log(r) for r in (0, 1))


def test_ctrl_c_waits_for_a_step_longer_than_the_grace_period_and_saves(tmp_path):
    """Issue 24: steps longer than the grace period (a large model's) lost the save to a SIGKILL.
    Now the wait covers the step in flight and the console says how long it is."""
    proc = sh.start(tmp_path, "slow-steps:3", "slow-steps:3", args=("--grace-period", "0.5"))
    run_dir = lambda: sh.run_dir_of(tmp_path)  # noqa: E731
    assert sh.wait_for(lambda: run_dir() is not None and all(
        "Step [1/1000]" in p.read_text() for p in run_dir().glob("worker-rank*.log")) and
        len(list(run_dir().glob("worker-rank*.log"))) == 2, timeout=60), "no step finished"
    proc.send_signal(signal.SIGINT)  # early in step 2: about 3 s of it left, six times the grace period
    code, _, err = sh.finish(proc, timeout=60)
    assert code == 130, err[-3000:]
    summary = _summary(tmp_path)
    assert summary["final_save"] == "saved" and [w["exit_code"] for w in summary["workers"]] == [130, 130]
    assert all(w["signals_sent"] == ["SIGINT"] for w in summary["workers"])
    assert "for the step in flight (about " in err and "grace period over" not in err


def test_sigquit_stops_the_workers_writes_the_summary_and_exits_131(tmp_path):
    """Issue 24: SIGQUIT used to kill the supervisor itself (no summary, workers left to the guard)."""
    code, err, summary = _signalled(tmp_path, signal.SIGQUIT, "forever", "forever", args=("--grace-period", "2"))
    assert code == 131, err[-3000:]
    # the scenario saves nothing on SIGQUIT (no save protocol of its own): the outcome says so
    assert summary["root_cause"]["kind"] == "terminated" and summary["root_cause"]["message"].startswith(
        "the supervisor received SIGQUIT; no save followed the signal, and gpuherd had seen no save by the script")
    assert {w["ended"] for w in summary["workers"]} == {"killed by SIGTERM"}
    assert "supervisor received SIGQUIT: SIGTERM to every worker (no save)" in err


def test_a_save_cut_by_the_stop_timeout_fails_the_run_and_says_so(tmp_path):
    proc = sh.start(tmp_path, "save-on:INT:60", "save-on:INT:60",
                    args=("--grace-period", "0.3", "--stop-timeout", "1.5"))
    _started(proc, tmp_path)
    proc.send_signal(signal.SIGINT)
    code, _, err = sh.finish(proc)
    assert code == 1, err[-3000:]
    summary = _summary(tmp_path)
    assert summary["final_save"] == "not saved" and summary["attempts"][0]["final_save"] == "not saved"
    message = summary["root_cause"]["message"]
    assert message.startswith("interrupted by Ctrl-C (SIGINT); the final checkpoint was NOT saved: ")
    assert "CPU0 (rank 0) was killed while saving it" in message and "CPU1 (rank 1)" in message
    assert "stop timeout over: SIGKILL to CPU0, CPU1" in err
    assert "the final checkpoint was NOT saved" in err  # the root-cause block on the console


def test_sigusr2_is_forwarded_to_a_script_that_handles_it(tmp_path):
    proc = sh.start(tmp_path, "usr2-log", "forever")
    _started(proc, tmp_path)
    proc.send_signal(signal.SIGUSR2)
    run_dir = sh.run_dir_of(tmp_path)
    assert sh.wait_for(lambda: "got SIGUSR2" in next(run_dir.glob("worker-rank0-*.log")).read_text(), timeout=20)
    assert proc.poll() is None  # forwarded, not a stop: the run goes on
    proc.send_signal(signal.SIGINT)
    code, _, err = sh.finish(proc)
    assert code == 130, err[-3000:]
    assert "supervisor received SIGUSR2: forwarded to CPU0; not to CPU1, which installed no handler" in err
    workers = _summary(tmp_path)["workers"]
    assert workers[0]["signals_sent"][0] == "SIGUSR2" and "SIGUSR2" not in workers[1]["signals_sent"]


def test_a_stopped_supervisor_does_not_mistake_its_own_pause_for_a_hang(tmp_path):
    """Ctrl-Z (SIGSTOP here) longer than the hang timeout, then SIGCONT: the heartbeats that
    piled up meanwhile are read first and the clocks restart; no false 124."""
    proc = sh.start(tmp_path, "forever", "forever", args=("--hang-timeout", "2"))
    _started(proc, tmp_path)
    proc.send_signal(signal.SIGSTOP)
    time.sleep(5)
    proc.send_signal(signal.SIGCONT)
    time.sleep(3)  # longer than the hang timeout again, now with the supervisor running
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGINT)
    code, _, err = sh.finish(proc)
    assert code == 130, err[-3000:]
    assert _summary(tmp_path)["root_cause"]["kind"] == "interrupted"


def _worker_of_rank(supervisor_pid: int, rank: int) -> psutil.Process | None:
    for p in sh.descendants(supervisor_pid):
        try:
            if p.environ().get("RANK") == str(rank) and p.environ().get("GPUHERD_SUPERVISED") == "1":
                return p
        except psutil.Error:
            continue
    return None


def test_a_terminal_that_stops_reading_never_delays_the_sigkill(tmp_path):
    """Nobody reads the supervisor's stdout/stderr (a paused pager): rank 0 floods the
    console, then fails; rank 1 ignores SIGTERM. The SIGKILL after the grace period still
    comes while the reader is paused, and the summary is written."""
    proc = sh.start(tmp_path, "flood-raise:40000", "ignore-term", args=("--grace-period", "1"))
    assert sh.wait_for(lambda: _worker_of_rank(proc.pid, 1) is not None, timeout=30)
    victim = _worker_of_rank(proc.pid, 1)
    try:
        assert sh.wait_for(lambda: not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE,
                           timeout=30), "rank 1 was not killed while the console was not read"
        run_dir = sh.run_dir_of(tmp_path)
        assert sh.wait_for(lambda: (run_dir / "summary.json").exists(), timeout=30)
    finally:
        code, _, err = sh.finish(proc)
    assert code == 1
    summary = _summary(tmp_path)
    assert summary["workers"][1]["ended"] == "killed by SIGKILL"
    assert "boom after 40000 lines" in " ".join(summary["root_cause"]["stderr_tail"])


@pytest.mark.slow
def test_two_runs_with_one_run_id_started_together_never_share_it(tmp_path):
    """Each pair starts at the same moment; the dataset is broken on purpose, so the winner
    stops right after taking the directory (exit 3) and the loser is refused (exit 2)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    args = ["--debug", "--set", "system.device=cpu", "--set", f"data.dataset={bad}", "--set", "data.tokenizer=byte"]
    for trial in range(10):
        cmd = [sys.executable, "-m", "supervisor", *args, "--run-id", f"race{trial}"]
        procs = [subprocess.Popen(cmd, cwd=tmp_path, env=sh.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(2)]
        results = [p.communicate(timeout=120) for p in procs]
        codes = sorted(p.returncode for p in procs)
        assert codes == [2, 3], results
        loser = next(err for p, (_, err) in zip(procs, results, strict=True) if p.returncode == 2)
        assert f"run directory {tmp_path / 'logs' / f'race{trial}'} already exists" in loser
        assert len(loser.strip().splitlines()) == 1 and "Traceback" not in loser


def test_stop_timeout_fits_slurms_kill_wait():
    assert within_kill_wait(120, 30) == 27  # SIGKILL of what is left and the summary before SLURM's
    assert within_kill_wait(120, 600) == 120
    assert within_kill_wait(10, 3) == 1


@pytest.mark.parametrize("now, saving, last_end, expected", [
    (5.0, True, None, 6.0),  # saving: a fresh grace period from now
    (5.0, False, 4.5, 5.5),  # just finished: a grace period from the end of the save
    (5.0, False, 0.5, None),  # a save from before the stop does not count
    (5.0, False, None, None),  # nobody saves: kill
    (9.7, True, None, 10.0),  # never past the stop timeout
    (10.0, True, None, None),
])
def test_the_grace_period_follows_the_saves(now, saving, last_end, expected):
    stop = GracefulStop(started=1.0, limit=10.0)
    assert stop.next_deadline(now, 1.0, saving, last_end) == expected


def test_a_second_sigterm_during_the_final_save_is_a_cut_save_exit_1(tmp_path):
    """The second SIGTERM kills at once, as documented; the save it cut is said, never a saved stop (143)."""
    proc = sh.start(tmp_path, "save-on:TERM:60", "save-on:TERM:60")
    _started(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # both workers are in their 60 s "save"
    proc.send_signal(signal.SIGTERM)
    code, _, err = sh.finish(proc)
    assert code == 1, err[-3000:]
    summary = _summary(tmp_path)
    assert summary["final_save"] == "not saved"
    message = summary["root_cause"]["message"]
    assert message.startswith("the supervisor received SIGTERM; the final checkpoint was NOT saved: "), message
    assert "CPU0 (rank 0) was killed while saving it" in message and message.endswith(
        "this run wrote no complete checkpoint"), message
    assert "SIGTERM again: killing every worker now" in err
