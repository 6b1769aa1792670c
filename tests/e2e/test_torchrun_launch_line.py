"""Every torchrun launch line, side by side: the same script, flags and environment under
`torchrun` and under `gpuherd run` in one test, asserting the same ranks, environment, files
and exit codes (or the difference docs/guide/torchrun.md documents, and why).

Small scripts (tests/e2e/dropin/show_env.py, show_env.sh), 2 CPU ranks, gloo.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil
import pytest

from tests.e2e.test_torchrun_dropin import SCRIPTS, _env, _free_port, gpuherd_run, torchrun

SHOW = str(SCRIPTS / "show_env.py")
CORES = len(os.sched_getaffinity(0))


def both(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
         unset: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """(gpuherd's, torchrun's) results of one launch line, each in its own working directory;
    `env` entries may name `{cwd}`, filled in with that directory."""
    results = []
    for name, launcher in (("ours", gpuherd_run()), ("theirs", torchrun())):
        cwd = tmp_path / name
        cwd.mkdir()
        run_env = {k: v for k, v in _env().items() if k not in unset}
        run_env.update({k: v.replace("{cwd}", str(cwd)) for k, v in (env or {}).items()})
        results.append(subprocess.run([*launcher, *args], cwd=cwd, env=run_env, capture_output=True, text=True,
                                      timeout=180))
    return results[0], results[1]


def seen(result: subprocess.CompletedProcess) -> dict[int, dict]:
    """Each rank's `ENV {...}` line, whatever prefix the launcher put before it."""
    envs = [orjson.loads(m) for m in re.findall(r"ENV (\{.*\})$", result.stdout, re.MULTILINE)]
    return {int(e["RANK"]): e for e in envs}


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def test_the_environment_a_rank_sees_is_torchruns(tmp_path):
    ours, theirs = both(tmp_path, "--nproc-per-node", "2", "--role", "trainer", "--signals-to-handle",
                        "SIGTERM,SIGUSR1", SHOW, "--lr", "1", unset=("OMP_NUM_THREADS",),
                        env={"TORCHELASTIC_ERROR_FILE": "{cwd}/error.json"})
    mine, reference = same_but_documented(seen(ok(ours)), seen(ok(theirs)), omp=str(max(1, CORES // 2)))
    assert mine[1]["ROLE_NAME"] == "trainer" and mine[1]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
    assert mine[0]["MASTER_ADDR"] == "localhost" and mine[0]["argv"] == ["--lr", "1"]
    # a run that succeeded writes nothing into the launcher's error file
    assert _error_file(tmp_path / "ours") is None and _error_file(tmp_path / "theirs") is None


def same_but_documented(mine: dict[int, dict], reference: dict[int, dict], omp: str = "1") -> tuple[dict, dict]:
    """Each rank's environment under both, equal but for the differences docs/guide/torchrun.md documents:
    NCCL's async error handling (gpuherd keeps torch's 3), CPU workers' threads (cores / workers
    where the user set none), and where each rank's own error file lies."""
    assert sorted(mine) == sorted(reference) == [0, 1]
    for rank in (0, 1):
        assert reference[rank].pop("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1"
        assert mine[rank].pop("TORCH_NCCL_ASYNC_ERROR_HANDLING") is None
        assert reference[rank].pop("OMP_NUM_THREADS") == "1"
        assert mine[rank].pop("OMP_NUM_THREADS") == omp
        for env in (mine, reference):  # each rank its own, never the launcher's
            assert env[rank].pop("TORCHELASTIC_ERROR_FILE").endswith(".json")
        assert mine[rank] == reference[rank]
    return mine, reference


def test_a_lone_worker_gets_no_omp_num_threads_as_under_torchrun(tmp_path):
    ours, theirs = both(tmp_path, "--nproc-per-node", "1", "--master-port", str(_free_port()), SHOW,
                        unset=("OMP_NUM_THREADS",))
    mine, reference = seen(ok(ours)), seen(ok(theirs))
    assert mine[0]["OMP_NUM_THREADS"] is None and reference[0]["OMP_NUM_THREADS"] is None
    assert mine[0]["MASTER_ADDR"] == reference[0]["MASTER_ADDR"] == "127.0.0.1"  # --master-addr's default


def test_pet_variables_are_flag_defaults_and_local_rank_macros_are_substituted(tmp_path):
    """PET_NPROC_PER_NODE / PET_NO_PYTHON as the flags; ${local_rank} per rank, $$ a dollar; a
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE prefixes every line as torchrun does with --tee."""
    ours, theirs = both(tmp_path, "--tee", "3", str(SCRIPTS / "show_env.sh"), "lr=${local_rank}", "$$HOME",
                        env={"PET_NPROC_PER_NODE": "2", "PET_NO_PYTHON": "1",
                             "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}-${rank}/${local_rank}]:"})
    lines = [sorted(line for line in ok(result).stdout.splitlines() if " rank=" in line) for result in (ours, theirs)]
    assert lines[0] == lines[1] == [
        "[default-0/0]:SH rank=0 local=0 of 2 args=lr=0 $HOME",
        "[default-1/1]:SH rank=1 local=1 of 2 args=lr=1 $HOME",
    ]


def _error_file(cwd: Path) -> dict | None:
    path = cwd / "error.json"
    return orjson.loads(path.read_bytes()) if path.exists() else None


def test_the_launchers_error_file_gets_the_failed_ranks_record(tmp_path):
    ours, theirs = both(tmp_path, "--nproc-per-node", "2", SHOW,
                        env={"TORCHELASTIC_ERROR_FILE": "{cwd}/error.json", "FAIL_RANK": "1"})
    assert ours.returncode == theirs.returncode == 1, ours.stderr[-2000:] + theirs.stderr[-2000:]
    mine, reference = _error_file(tmp_path / "ours"), _error_file(tmp_path / "theirs")
    assert reference is not None and mine is not None, ours.stderr[-2000:]
    for data in (mine, reference):
        assert data["message"]["message"] == "RuntimeError: boom on rank 1"
        assert data["message"]["errorCode"] == 1
        assert data["message"]["extraInfo"]["py_callstack"].rstrip().endswith("RuntimeError: boom on rank 1")
    assert set(mine["message"]) == set(reference["message"])


def test_without_a_rank_record_gpuherd_still_writes_the_root_cause(tmp_path):
    """Documented difference: torchrun leaves the file unwritten when no rank wrote one."""
    ours, theirs = both(tmp_path, "--nproc-per-node", "2", SHOW,
                        env={"TORCHELASTIC_ERROR_FILE": "{cwd}/error.json", "FAIL_RANK": "1", "FAIL_WITH": "3"})
    assert ours.returncode == 3 and theirs.returncode == 1  # the script's code passed on (docs/reference/exit-codes.md)
    assert _error_file(tmp_path / "theirs") is None
    mine = _error_file(tmp_path / "ours")
    assert mine["message"]["errorCode"] == 3 and "rank 1" in mine["message"]["message"]


@pytest.mark.slow  # torch imported by 4 ranks
def test_python_exec_without_gpuherds_dependencies_trains_with_heartbeats(tmp_path):
    """PYTHON_EXEC names an interpreter with torch but without orjson: the script runs under both,
    and gpuherd still counts its optimizer steps."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "orjson.py").write_text("raise ModuleNotFoundError(\"No module named 'orjson'\")\n")
    python = tmp_path / "python-without-orjson"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={blocked} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    script = tmp_path / "steps.py"
    script.write_text("import torch\nm = torch.nn.Linear(2, 1)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n    m(torch.ones(1, 2)).sum().backward(); opt.step()\n"
                      "import sys; sys.stdout.write('STEPS done\\n')\n")
    ours, theirs = both(tmp_path, "--nproc-per-node", "2", str(script), env={"PYTHON_EXEC": str(python)})
    assert ok(theirs).stdout.count("STEPS done") == 2
    # gpuherd's console folds a line both ranks print alike (within 0.2 s) into one naming both
    assert ok(ours).stdout.count("STEPS done") == 2 or "CPU[0-1]:STEPS done" in ours.stdout
    assert "WARNING" not in ours.stdout + ours.stderr.replace("supervisor:WARNING", "")
    run_dir = next((tmp_path / "ours" / "logs").iterdir())
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert [w["last_step"] for w in summary["workers"]] == [3, 3]


def test_flags_outside_the_old_list_launch_as_under_torchrun(tmp_path):
    ours, theirs = both(tmp_path, "--nproc-per-node", "2", "--rdzv-conf", "join_timeout=60,read_timeout=30",
                        "--shutdown-timeout", "5", "--event-log-handler", "null", "--local-addr", "127.0.0.1",
                        "--master-port", str(_free_port()), "--run-path", "--duplicate-stdout-filters", "ENV",
                        "--virtual-local-rank", SHOW)
    mine, _ = same_but_documented(seen(ok(ours)), seen(ok(theirs)))
    assert [(mine[r]["LOCAL_RANK"], mine[r]["CUDA_VISIBLE_DEVICES"]) for r in (0, 1)] == [("0", "0"), ("0", "1")]
    assert "no effect here" in ours.stderr and "--event-log-handler, --duplicate-stdout-filters" in ours.stderr


@pytest.mark.slow  # torch imported by 2 ranks and each launcher's timer server
def test_an_expired_file_timer_kills_the_stuck_rank(tmp_path):
    """TORCHELASTIC_ENABLE_FILE_TIMER=1: torch's FileTimerServer kills the rank whose timer expired.
    Under torchrun the server then kills torchrun itself (SIGKILL: the shell sees 137, as gpuherd's
    exit code says) and leaves its other rank behind; gpuherd names the timer and leaves nothing."""
    script = tmp_path / "stuck_timer.py"  # a copy: its path finds torchrun's orphans below
    script.write_bytes((SCRIPTS / "stuck_timer.py").read_bytes())
    try:
        ours, theirs = both(tmp_path, "--nproc-per-node", "2", str(script),
                            env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"})
    finally:
        for proc in psutil.process_iter(["cmdline"]):
            if str(script) in (proc.info["cmdline"] or []) and proc.pid != os.getpid():
                proc.kill()
    assert theirs.returncode == -signal.SIGKILL and "rank 0 done" in theirs.stdout, theirs.stderr[-2000:]
    assert ours.returncode == 128 + signal.SIGKILL, ours.stderr[-2000:]
    run_dir = next((tmp_path / "ours" / "logs").iterdir())
    cause = orjson.loads((run_dir / "summary.json").read_bytes())["root_cause"]
    assert cause["rank"] == 1 and "'stuck step' expired" in cause["message"]
    timer_files = [re.search(r"rank 0 done, timers on (\S+)", r.stdout)[1] for r in (ours, theirs)]
    assert timer_files[0] == str(run_dir / "file-timer.fifo")
    assert timer_files[1].startswith(tempfile.gettempdir())  # torchrun: a fresh name in the temp directory


ELASTIC = Path(__file__).resolve().parents[1] / "supervisor" / "workers" / "elastic.py"
PLACE = re.compile(r"rank \d+/\d+ sum=\d+ group \d+/\d+ restart_count \d+")


def _elastic_node(launcher: list[str], cwd: Path, node_rank: int, port: int) -> subprocess.Popen:
    """One node of `--nnodes 1:2` (c10d), its output in cwd/node{R}.out; elastic.py waits for 2 ranks.
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for both launchers: without it torch 2.13's c10d rendezvous
    writes the workers' MASTER_ADDR for its first round only (dynamic_rendezvous.next_rendezvous
    keeps `_bootstrap_store_info`), and a late node waits 60 s for the next round's, then fails."""
    cwd.mkdir(exist_ok=True)
    out = (cwd / f"node{node_rank}.out").open("w")
    return subprocess.Popen(
        [*launcher, "--nnodes", "1:2", "--nproc-per-node", "1", "--node-rank", str(node_rank), "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job", "--rdzv-conf", "last_call_timeout=1",
         "--max-restarts", "0", str(ELASTIC), "2"], cwd=cwd, env=_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        stdout=out, stderr=subprocess.STDOUT)


def _elastic_job(launcher: list[str], cwd: Path) -> tuple[tuple[int, list[str]], tuple[int, list[str]]]:
    """Node 0 starts alone (MIN 1); node 1 joins late, at a restart that --max-restarts 0 allows.
    Each node's (exit code, the places its ranks printed)."""
    port = _free_port()
    first = _elastic_node(launcher, cwd, 0, port)
    nodes = [first]
    try:
        deadline = time.monotonic() + 180
        while "rank 0/1 " not in (cwd / "node0.out").read_text():
            assert first.poll() is None and time.monotonic() < deadline, (cwd / "node0.out").read_text()[-3000:]
            time.sleep(0.2)
        nodes.append(_elastic_node(launcher, cwd, 1, port))
        codes = [node.wait(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    said = [(cwd / f"node{r}.out").read_text() for r in (0, 1)]
    return (codes[0], PLACE.findall(said[0])), (codes[1], PLACE.findall(said[1]))


@pytest.mark.slow  # torch imported by 3 ranks per launcher
def test_an_elastic_node_range_admits_a_late_node_at_an_uncounted_restart_as_under_torchrun(tmp_path):
    """--nnodes MIN:MAX: the job starts with MIN nodes; a node arriving later joins at the next
    restart, which neither launcher counts against --max-restarts (0 here): the same places,
    the same TORCHELASTIC_RESTART_COUNT, both nodes exit 0."""
    theirs = _elastic_job(torchrun(), tmp_path / "theirs")
    ours = _elastic_job(gpuherd_run(), tmp_path / "ours")
    assert theirs == ((0, ["rank 0/1 sum=1 group 0/1 restart_count 0", "rank 0/2 sum=2 group 0/2 restart_count 0"]),
                      (0, ["rank 1/2 sum=2 group 1/2 restart_count 0"])), theirs
    assert ours == theirs, [(tmp_path / "ours" / f"node{r}.out").read_text()[-3000:] for r in (0, 1)]
