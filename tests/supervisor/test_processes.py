"""The supervisor on real worker processes with real signals (issue 4's failure list).

Every test asserts the exit code, the summary and (through conftest's autouse
fixture, plus explicit checks where the supervisor itself dies) that no process is left.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time

import psutil
import pytest

from tests.supervisor import helpers as sh

FAST = ("--grace-period", "1")


def _roles(summary: dict) -> dict[int, str]:
    return {w["rank"]: w["role"] for w in summary["workers"]}


def test_clean_run_exits_0_and_writes_everything(tmp_path):
    r = sh.run(tmp_path, "train:5", "train:5")
    assert r.code == 0, r.err
    s = r.summary
    assert s["exit_code"] == 0 and s["outcome"] == "success" and s["root_cause"] is None
    assert [w["last_step"] for w in s["workers"]] == [5, 5]
    assert "CPU0:INFO | [CPU 0] Step [4/5]" in r.err and "CPU1:INFO | [CPU 1] Step [4/5]" in r.err
    assert "CPU1:INFO | [CPU 1] Step [4/5]" in r.log(1)
    metrics = (r.run_dir / "metrics.jsonl").read_text().splitlines()
    assert sum('"type":"step"' in m for m in metrics) == 10 and sum('"type":"done"' in m for m in metrics) == 2
    assert (r.run_dir / "config.json").is_file() and (r.run_dir / "supervisor.log").is_file()


def test_worker_that_raises_is_the_root_cause_and_the_other_is_torn_down(tmp_path):
    r = sh.run(tmp_path, "forever", "raise", args=FAST)
    assert r.code == 1, r.err
    s = r.summary
    cause = s["root_cause"]
    assert (cause["kind"], cause["rank"], cause["device"], cause["exit_code"]) == ("worker-exit", 1, "CPU1", 1)
    assert any("RuntimeError: boom from rank 1" in line for line in cause["stderr_tail"])
    assert _roles(s) == {0: "victim", 1: "first-failure"}
    assert s["workers"][0]["ended"] == "killed by SIGTERM"
    assert s["teardown_s"] < 1.0
    assert "root cause: CPU1 (rank 1) exit code 1" in r.err and "RuntimeError: boom from rank 1" in r.err


def test_worker_killed_by_sigkill_gives_137(tmp_path):
    r = sh.run(tmp_path, "forever", "sigkill", args=FAST)
    assert r.code == 137, r.err
    assert r.summary["root_cause"]["message"].startswith("CPU1 (rank 1) killed by SIGKILL")


def test_a_rank_exiting_0_early_is_finished_while_the_others_progress(tmp_path):
    r = sh.run(tmp_path, "train:150", "exit0", args=(*FAST, "--hang-timeout", "1"))
    assert r.code == 0, r.err
    assert "CPU1 (rank 1) exited 0 first (step 2, phase train); rank(s) 0 may finish at their own pace" in r.err
    assert all(w["signals_sent"] == [] and w["exit_code"] == 0 for w in r.summary["workers"])


def test_early_exit_while_the_other_rank_saves_kills_nothing(tmp_path):
    """A rank in phase checkpoint longer than the hang timeout is never killed for another's clean exit."""
    r = sh.run(tmp_path, "slow-save:3", "exit0", args=(*FAST, "--hang-timeout", "1"))
    assert r.code == 0, r.err
    assert all(w["signals_sent"] == [] and w["exit_code"] == 0 for w in r.summary["workers"])
    assert "saving the final checkpoint" in r.log(0)


def test_early_exit_then_no_progress_is_a_hang_that_names_the_exit(tmp_path):
    r = sh.run(tmp_path, "stall", "exit0", args=(*FAST, "--hang-timeout", "1"))
    assert r.code == 124, r.err
    cause = r.summary["root_cause"]
    assert cause["kind"] == "hang" and cause["rank"] == 0
    assert "CPU1 (rank 1) had exited 0" in cause["message"]


def test_silent_script_rank_exiting_early_fails_once_the_other_makes_no_progress(tmp_path):
    started = time.monotonic()
    r = sh.run(tmp_path, "silent-stall+nofh", "silent-exit0+nofh", args=(*FAST, "--hang-timeout", "1"))
    assert r.code == 124, r.err
    cause = r.summary["root_cause"]
    assert cause["kind"] == "early-exit" and cause["rank"] == 1
    assert "CPU1 (rank 1) exited 0, then rank(s) 0 made no progress for 1 s" in cause["message"]
    assert time.monotonic() - started < 20


def test_a_script_that_never_steps_is_said_to_be_unwatched_once(tmp_path):
    script = tmp_path / "no_steps.py"
    script.write_text("import time\ntime.sleep(3)\n")
    cmd = sh.command("--hang-timeout", "1", "--set", "system.startup_timeout=1", script=script)
    result = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    notices = [line for line in result.stderr.splitlines() if "sent no heartbeat in their first 1 s" in line]
    assert len(notices) == 1 and "rank(s) 0, 1" in notices[0] and "no torch optimizer step seen" in notices[0]


def test_a_module_runs_with_dash_m_as_under_python(tmp_path):
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "job.py").write_text(
        "import os, sys\nprint('rank', os.environ['RANK'], __name__, sys.argv[1:], flush=True)\n")
    cmd = sh.command("-m", "userpkg.job", "--lr", "1", script=None)
    result = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "CPU0:rank 0 __main__ ['--lr', '1']" in result.stdout and "CPU1:rank 1 __main__" in result.stdout


def test_stopped_worker_is_named_as_straggler_and_every_rank_dumps_stacks(tmp_path):
    r = sh.run(tmp_path, "forever", "stop", args=(*FAST, "--hang-timeout", "1"))
    assert r.code == 124, r.err
    cause = r.summary["root_cause"]
    assert cause["kind"] == "hang" and cause["rank"] == 1
    assert "rank 1 sent no heartbeat" in cause["message"] and "steps reached: rank 0=" in cause["message"]
    assert "most recent call first" in r.log(0)  # faulthandler's stack dump reached rank 0's log
    assert r.summary["workers"][1]["ended"] in ("killed by SIGTERM", "killed by SIGKILL")


def test_hang_of_a_script_without_sigusr1_handler_is_explained(tmp_path):
    # without the bootstrap (which registers faulthandler on SIGUSR1), as torchrun starts it
    r = sh.run(tmp_path, "forever+nofh", "stall+nofh", args=(*FAST, "--hang-timeout", "1", "--no-auto-heartbeat"))
    assert r.code == 124, r.err
    assert r.summary["root_cause"]["rank"] == 1
    assert any("no SIGUSR1 handler" in n for n in r.summary["notes"])
    # SIGUSR1's default action would have killed them: they must have been stopped by teardown instead
    # (the hung rank by SIGKILL: it could not act on SIGTERM, and its grace is not waited out)
    assert {w["rank"]: w["ended"] for w in r.summary["workers"]} == {0: "killed by SIGTERM", 1: "killed by SIGKILL"}


def test_worker_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    r = sh.run(tmp_path, "ignore-term", "raise", args=FAST)
    assert r.code == 1, r.err
    w0 = r.summary["workers"][0]
    assert w0["ended"] == "killed by SIGKILL" and w0["signals_sent"][:1] == ["SIGTERM"] and "SIGKILL" in w0["signals_sent"]
    assert 0.9 <= r.summary["teardown_s"] < 5


def test_flood_of_100k_lines_per_worker_loses_and_tears_nothing(tmp_path):
    r = sh.run(tmp_path, "flood:100000", "flood:100000")
    assert r.code == 0, r.err[-2000:]
    line = re.compile(r"^CPU(\d):flood line (\d{6}) from rank (\d) x{40}$")
    for rank in (0, 1):
        numbers = [int(m[2]) for m in map(line.match, r.log(rank).splitlines()) if m and m[1] == m[3] == str(rank)]
        assert numbers == list(range(100000))
    console = [ln for ln in r.out.splitlines() if "flood" in ln]
    assert len(console) == 200000 and all(line.match(ln) for ln in console)


def test_crash_mid_line_keeps_the_half_line(tmp_path):
    r = sh.run(tmp_path, "forever", "midline", args=FAST)
    assert r.code == 3, r.err
    assert "CPU1:fatal: half a line without newli" in r.log(1).splitlines()
    assert r.summary["root_cause"]["stderr_tail"][-1] == "fatal: half a line without newli"




@pytest.mark.parametrize("behaviours", [("grandchild", "escapee", "raise-after:0,1: pid ")])
def test_forked_processes_never_outlive_a_failed_run(tmp_path, behaviours):
    # rank 2 fails only once both forks are logged: a bare raise could end the run first
    r = sh.run(tmp_path, *behaviours, args=(*FAST, "--nproc", "3"))
    assert r.code == 1, r.err
    pids = [int(m) for m in re.findall(r"(?:grandchild|escapee) pid (\d+)", r.log(0) + r.log(1))]
    assert len(pids) == 2
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _living(family: list[psutil.Process], marked: list[int]) -> list[int]:
    """Processes still running (a zombie is dead, merely not yet reaped by its new parent)."""
    alive = []
    for p in [*family, *map(psutil.Process, [m for m in marked if psutil.pid_exists(m)])]:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p.pid)
        except psutil.Error:
            continue
    return sorted(set(alive))


def test_sigkilled_supervisor_leaves_no_descendant_within_a_second(tmp_path):
    proc = sh.start(tmp_path, "grandchild", "escapee")
    try:
        assert sh.wait_for(lambda: sh.workers_started(proc, 2, tmp_path, lines=3)), "workers never started"
        family = sh.descendants(proc.pid)
        marked = sh.marked_processes(proc.pid)
        assert len(marked) >= 4  # 2 workers, a grandchild, an escapee in its own session
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and _living(family, marked):
            time.sleep(0.02)
        assert not _living(family, marked), f"survivors after 1 s: {_living(family, marked)}"
    finally:
        proc.kill()
        proc.communicate()


def test_the_rank_that_left_first_is_the_root_cause_not_the_survivor_that_failed_on_its_absence(tmp_path):
    """Issue 24: rank 1 exited 0 early; rank 0 then died on gloo's 'Connection closed by peer'."""
    r = sh.run(tmp_path, "peer-gone:1", "leave", args=FAST)
    assert r.code == 1, r.err[-3000:]
    cause = r.summary["root_cause"]
    assert (cause["kind"], cause["rank"], cause["device"]) == ("early-exit", 1, "CPU1"), cause
    assert cause["message"].startswith("CPU1 (rank 1) left first: it exited 0 (step 2, phase train) while the "
                                       "others still ran; then CPU0 (rank 0) exit code 1"), cause["message"]
    assert "Connection closed by peer" in cause["message"] and cause["message"].endswith("a consequence of its absence")
    assert any("Connection closed by peer" in line for line in cause["stderr_tail"])  # the survivor's words


def test_one_ctrl_c_asks_workers_to_stop_gracefully(tmp_path):
    proc = sh.start(tmp_path, "graceful", "graceful", args=("--grace-period", "10"))
    assert sh.wait_for(lambda: sh.workers_started(proc, 2, tmp_path, lines=3))
    proc.send_signal(signal.SIGINT)
    code, out, err = sh.finish(proc)
    assert code == 130, err
    run_dir = sh.run_dir_of(tmp_path)
    summary = sh.Result(code, out, err, run_dir).summary
    assert summary["outcome"] == "interrupted"
    assert [w["exit_code"] for w in summary["workers"]] == [130, 130]
    assert all(w["signals_sent"] == ["SIGINT"] for w in summary["workers"])
    assert "saving checkpoint" in err


def test_second_ctrl_c_kills_at_once(tmp_path):
    proc = sh.start(tmp_path, "ignore-int", "ignore-int", args=("--grace-period", "60"))
    assert sh.wait_for(lambda: sh.workers_started(proc, 2, tmp_path, lines=3))
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, _, err = sh.finish(proc)
    assert code == 130, err
    assert time.monotonic() - started < 10  # not the 60 s grace period
    summary = sh.Result(code, "", err, sh.run_dir_of(tmp_path)).summary
    assert {w["ended"] for w in summary["workers"]} == {"killed by SIGKILL"}


def test_sigterm_to_the_supervisor_exits_143(tmp_path):
    proc = sh.start(tmp_path, "forever", "forever", args=FAST)
    assert sh.wait_for(lambda: sh.workers_started(proc, 2, tmp_path, lines=3))
    proc.send_signal(signal.SIGTERM)
    code, _, err = sh.finish(proc)
    assert code == 143, err
    summary = sh.Result(code, "", err, sh.run_dir_of(tmp_path)).summary
    assert summary["root_cause"]["kind"] == "terminated"
    assert {w["ended"] for w in summary["workers"]} == {"killed by SIGTERM"}


def test_two_supervisors_at_once_rendezvous_on_their_own_ports(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    # One worker each keeps the cost (torch imports) down; it still rendezvouses through its store.
    procs = [sh.start(d, args=("--nproc", "1"), script=sh.ALLREDUCE) for d in dirs]
    results = [sh.finish(p, timeout=240) for p in procs]
    ports = set()
    for code, out, err in results:
        assert code == 0, err[-3000:]
        assert out.count("sum=1") == 1
        ports |= set(re.findall(r"port=(\d+)", out))
    assert len(ports) == 2


def test_worker_environment_is_torchrun_compatible(tmp_path):
    r = sh.run(tmp_path, "env", "env")
    assert r.code == 0, r.err
    import json

    envs = {int(e["RANK"]): e for e in (json.loads(ln.split("ENV ", 1)[1]) for ln in r.out.splitlines() if "ENV " in ln)}
    assert sorted(envs) == [0, 1]
    for rank, e in envs.items():
        assert e["LOCAL_RANK"] == str(rank) and e["WORLD_SIZE"] == e["LOCAL_WORLD_SIZE"] == "2"
        assert e["MASTER_ADDR"] == "localhost" and e["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # as torchrun
        assert e["GPUHERD_DEVICE_KIND"] == "cpu" and e["GPU_RANK"] == str(rank) and e["GPUHERD_SUPERVISED"] == "1"
        assert e["TORCHELASTIC_RUN_ID"] == r.run_dir.name and e["GPUHERD_RUN_DIR"] == str(r.run_dir)
        assert e["OMP_NUM_THREADS"].isdigit() and "CUDA_VISIBLE_DEVICES" not in e
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_log_ranks_shows_rank_0_and_everyones_errors(tmp_path):
    r = sh.run(tmp_path, "train:3", "raise-after:0", args=("--log-ranks", "0", *FAST))
    assert r.code == 1
    assert "CPU0:INFO | [CPU 0] Step [2/3]" in r.err
    assert "CPU1:INFO" not in r.err  # rank 1's chatter stays in its file
    assert "CPU1:Traceback (most recent call last):" in r.err and "CPU1:RuntimeError: boom from rank 1" in r.err
    assert "CPU1:INFO | [CPU 1] Step [2/3]" in r.log(1)


def test_collapse_logs_prints_identical_lines_once(tmp_path):
    r = sh.run(tmp_path, "train:3", "train:3", args=("--collapse-logs",))
    assert r.code == 0, r.err
    assert "CPU[0-1]:INFO | [CPU *] Step [2/3] | Loss: 9.9800" in r.err
    assert "CPU0:INFO | [CPU 0] Step [2/3]" not in r.err
    assert "CPU0:INFO | [CPU 0] Step [2/3] | Loss: 9.9800" in r.log(0)


@pytest.mark.parametrize("args, fragment", [
    (("--nproc", "0"), "system.nproc must be > 0"),
    (("--gpus", "a,b"), "argument --gpus"),
    (("--run-id", "../x"), "--run-id '../x'"),
    (("--grace-period", "-1"), "system.grace_period must be within (0, "),
    (("--log-ranks", "5"), "--log-ranks 5"),
    (("--script", "missing.py"), "script not found: missing.py"),
    (("-m",), "-m needs a script or module to run"),
    (("--nproc-per-node", "xpu"), "--nproc-per-node 'xpu'"),
    (("--nnodes", "4:1"), "expected 1 <= MIN <= MAX"),
    (("--standalone", "--nnodes", "2"), "--standalone runs one node"),
    (("--master-addr", "10.255.255.1", "--set", "system.nproc=1"), "is not an address of this machine"),
    # an argument error is named before the machine is judged: here no disk holds one checkpoint
    (("--master-addr", "10.255.255.1", "--set", "system.nproc=1", *sh.HUGE_MODEL), "is not an address of this machine"),
])
def test_bad_supervisor_options_exit_2_before_anything_is_written(tmp_path, args, fragment):
    cmd = sh.command(*args, script=None)
    p = subprocess.run(cmd, cwd=tmp_path, env=sh.env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], p.stderr
    assert list(tmp_path.iterdir()) == []
