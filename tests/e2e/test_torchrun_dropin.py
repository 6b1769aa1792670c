"""`torchrun` -> `gpuherd run` and nothing else: real scripts, unchanged, under both launchers.

The scripts in tests/e2e/dropin/ carry no gpuherd code: a nanoGPT-style DDP script,
PyTorch Lightning, Lightning Fabric, DeepSpeed ZeRO-2 on CPU, HuggingFace accelerate and a
`transformers.Trainer` (from PyPI, requirements-dev.txt; each test skips itself where its package is missing).
Each comparison runs the same script under torchrun and under gpuherd in the same test
and asserts identical losses; the others show what gpuherd adds without code in the
script (a stopped rank named, a slow final save left alone).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
import psutil
import pytest

from tests.supervisor import helpers as sh

SCRIPTS = Path(__file__).resolve().parent / "dropin"
LOSS = re.compile(r"^(?:CPU0:)?step (\d+) loss ([0-9.]+)$", re.MULTILINE)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    # one thread per rank under both launchers (torchrun's default), so the floats agree to the bit
    env.update(OMP_NUM_THREADS="1", GPUHERD_PYTHON=sys.executable, **extra)
    return env


def gpuherd_run() -> list[str]:
    """The installed command (bash install.sh), else the same command through its wrapper."""
    installed = Path(sys.executable).with_name("gpuherd")
    return [str(installed), "run"] if installed.exists() else ["bash", str(sh.REPO_ROOT / "run_training.sh")]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def launch(launcher: list[str], cwd: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, "--nproc-per-node", "2", *args], cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


def losses(result: subprocess.CompletedProcess) -> list[tuple[int, str]]:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return _losses_in(result.stdout)


def _losses_in(stdout: str) -> list[tuple[int, str]]:
    found = [(int(step), loss) for step, loss in LOSS.findall(stdout)]
    assert found, stdout[-2000:]
    return found


def reference_losses(result: subprocess.CompletedProcess) -> list[tuple[int, str]]:
    """torchrun's losses, the reference. Its ranks keep torch's exit race that gpuherd's
    bootstrap closes (gpuherd/gloo_exit.py): now and then a rank dies of SIGABRT after
    its last step, "terminate called without an active exception". That death, and no other,
    leaves the reference standing; the losses it printed must still be all of ours."""
    if (result.returncode == 1 and "(SIGABRT)" in result.stderr
            and "terminate called without an active exception" in result.stderr):
        return _losses_in(result.stdout)
    return losses(result)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _same_run_under_both(tmp_path: Path, flags: list[str], script: str) -> tuple[subprocess.CompletedProcess, ...]:
    """The same launch line under both, `torchrun` replaced by `gpuherd run`; the losses must agree."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    if "--standalone" in flags:  # each launcher picks a free port of its own: both at once
        with ThreadPoolExecutor(max_workers=2) as pool:
            pending = pool.submit(launch, torchrun(), tmp_path / "b", *flags, str(SCRIPTS / script))
            ours = launch(gpuherd_run(), tmp_path / "a", *flags, str(SCRIPTS / script))
            theirs = pending.result()
    else:  # torchrun first: a fixed --master-port is then free again for gpuherd, which binds it with SO_REUSEADDR
        theirs = launch(torchrun(), tmp_path / "b", *flags, str(SCRIPTS / script))
        ours = launch(gpuherd_run(), tmp_path / "a", *flags, str(SCRIPTS / script))
    assert losses(ours) == reference_losses(theirs)
    return ours, theirs


@pytest.mark.slow
def test_nanogpt_style_script_trains_as_under_torchrun_and_heartbeats_without_code(tmp_path):
    ours, _ = _same_run_under_both(tmp_path, ["--standalone"], "nanogpt_ddp.py")
    run_dir = sh.run_dir_of(tmp_path / "a")
    records = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    steps = {(r["rank"], r["step"]) for r in records if r["type"] == "step"}
    assert (0, 1) in steps and (1, 1) in steps and (0, 20) in steps  # the first step at once, the last at exit
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["exit_code"] == 0 and [w["last_step"] for w in summary["workers"]] == [20, 20]


@pytest.mark.slow
@pytest.mark.parametrize("package, script", [("pytorch_lightning", "lightning_train.py"),
                                             ("lightning_fabric", "fabric_train.py")])
def test_lightning_and_fabric_scripts_run_unchanged_under_torchelastic_detection(tmp_path, package, script):
    pytest.importorskip(package, reason="a dev dependency (pytorch-lightning): pip install -r requirements-dev.txt")
    ours, theirs = _same_run_under_both(tmp_path, [], script)
    for result in (ours, theirs):  # Lightning saw a torchelastic launch and started no processes of its own
        assert "environment TorchElasticEnvironment creates_processes_externally=True" in result.stdout


@pytest.mark.slow
def test_deepspeed_zero2_script_runs_unchanged_on_cpu(tmp_path):
    pytest.importorskip("deepspeed", reason="a dev dependency: pip install -r requirements-dev.txt")
    ours, theirs = _same_run_under_both(tmp_path, ["--standalone"], "deepspeed_train.py")
    for result in (ours, theirs):
        assert "zero stage 2" in result.stdout


@pytest.mark.slow
def test_accelerate_script_runs_unchanged_as_multi_cpu(tmp_path):
    pytest.importorskip("accelerate", reason="a dev dependency: pip install -r requirements-dev.txt")
    port = _free_port()
    ours, theirs = _same_run_under_both(tmp_path, ["--master-addr", "127.0.0.1", "--master_port", str(port)],
                                        "accelerate_train.py")
    for result in (ours, theirs):
        assert "setup DistributedType.MULTI_CPU num_processes=2" in result.stdout
    assert f"rendezvous store on 127.0.0.1:{port}" in (sh.run_dir_of(tmp_path / "a") / "supervisor.log").read_text()


@pytest.mark.slow
def test_hf_trainer_script_trains_as_under_torchrun(tmp_path):
    """transformers.Trainer reads torchrun's environment itself (LOCAL_RANK, WORLD_SIZE): a 2-layer
    Llama from a config on synthetic tokens, DDP over gloo, the same losses under both launchers."""
    pytest.importorskip("transformers", reason="a dev dependency: pip install -r requirements-dev.txt")
    ours, theirs = _same_run_under_both(tmp_path, ["--standalone"], "hf_trainer_train.py")
    for result in (ours, theirs):
        assert "setup ParallelMode.DISTRIBUTED world_size=2" in result.stdout
    assert [step for step, _ in losses(ours)] == list(range(8))


def test_the_users_pythonpath_and_sys_path_are_exactly_torchruns(tmp_path):
    """A user package named `worker` on the user's PYTHONPATH is what the script imports."""
    lib = tmp_path / "lib" / "worker"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("WHO = 'the user'\n")
    script = tmp_path / "show_path.py"
    script.write_text("import json, os, sys\nimport worker\n"
                      "if os.environ['RANK'] == '0':\n"
                      "    print('PATH ' + json.dumps([worker.WHO, os.environ.get('PYTHONPATH'), sys.path]), flush=True)\n")
    env = _env(PYTHONPATH=str(tmp_path / "lib"))
    seen = []
    for launcher in (gpuherd_run(), torchrun()):
        result = launch(launcher, tmp_path, str(script), env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        seen.append(orjson.loads(re.search(r"PATH (.*)$", result.stdout, re.MULTILINE)[1]))
    assert seen[0] == seen[1]
    assert seen[0][:2] == ["the user", str(tmp_path / "lib")]


def _pid_of_rank(supervisor: psutil.Process, rank: int) -> int | None:
    for proc in supervisor.children(recursive=True):
        try:
            if proc.environ().get("RANK") == str(rank) and proc.environ().get("GPUHERD_SUPERVISED") == "1":
                return proc.pid
        except psutil.Error:
            continue
    return None


@pytest.mark.slow
def test_a_sigstopped_rank_of_a_script_without_gpuherd_code_is_named_within_the_hang_timeout(tmp_path):
    hang = 3.0
    cmd = [*gpuherd_run(), "--nproc-per-node", "2", "--hang-timeout", str(hang), "--grace-period", "2",
           str(SCRIPTS / "nanogpt_ddp.py"), "100000", "--sleep", "0.02"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:  # rank 0's steps: both ranks are past their first optimizer step
            lines.append(line)
            if line.startswith("CPU0:step 5 "):
                break
        rank1 = _pid_of_rank(psutil.Process(proc.pid), 1)
        assert rank1 is not None, "".join(lines)
        os.kill(rank1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        code, _, err = sh.finish(proc, timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert code == 124, err[-3000:]
    # found at all, and long before a wait that never ends would be cut (a loaded CI machine
    # stretches the stack dump and the grace period, so no tighter bound is asserted)
    assert took < 40, f"{took:.1f} s from SIGSTOP to exit"
    run_dir = sh.run_dir_of(tmp_path)
    cause = orjson.loads((run_dir / "summary.json").read_bytes())["root_cause"]
    assert (cause["kind"], cause["rank"]) == ("hang", 1)
    assert cause["message"].startswith("hang: rank 1 (the kernel shows it cannot run): rank 1 sent no heartbeat")
    assert cause["evidence"][0].startswith("rank 1 sent no heartbeat") and "process stopped (state T)" in \
        cause["evidence"][0]
    assert "most recent call first" in next(run_dir.glob("worker-rank0-*.log")).read_text()  # SIGUSR1 stacks


@pytest.mark.slow
def test_a_rank_exiting_0_while_the_other_saves_longer_than_the_hang_timeout_kills_nothing(tmp_path):
    result = subprocess.run([*gpuherd_run(), "--nproc-per-node", "2", "--hang-timeout", "2",
                             str(SCRIPTS / "nanogpt_ddp.py"), "5", "--save-slowly", "5"],
                            cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CPU0:saved" in result.stdout and (tmp_path / "final.pt").is_file()
    summary = orjson.loads((sh.run_dir_of(tmp_path) / "summary.json").read_bytes())
    assert all(w["exit_code"] == 0 and w["signals_sent"] == [] for w in summary["workers"])
