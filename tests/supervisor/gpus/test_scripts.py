"""train_gpu.sh and train_auto_gpu.sh for real: argument handling, the exec into the
supervisor, no-GPU errors, and the claim that survives exec (two auto jobs at once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_nvml import machine, subprocess_env

REPO = Path(__file__).resolve().parents[3]
TRAIN_GPU, TRAIN_AUTO = REPO / "train_gpu.sh", REPO / "train_auto_gpu.sh"

# Stands in for the interpreter: `-m supervisor ...` (the training run) reports its argv,
# its pid and who holds the claim on its GPU; anything else runs the real Python.
STUB = """#!/usr/bin/env bash
if [[ "$1 $2" == "-m supervisor" ]]; then
  echo "supervisor argv: $*"
  echo "pid: $$"
  if [[ -n "${GPUHERD_GPU_CLAIM_FDS:-}" ]]; then
    uuid="${GPUHERD_GPU_CLAIM_FDS%%=*}"
    echo "claim holder: $(%(py)s -c "from supervisor.gpus.claim import claim_holder; print(claim_holder('$uuid'))")"
  fi
  sleep "${STUB_SLEEP:-0}"
  exit 0
fi
exec %(py)s "$@"
"""


@pytest.fixture
def stub_env(tmp_path):
    stub = tmp_path / "python-stub"
    stub.write_text(STUB % {"py": sys.executable})
    stub.chmod(0o755)
    env = dict(os.environ, GPUHERD_PYTHON=str(stub), GPUHERD_LOCK_DIR=str(tmp_path / "locks"),
               GPUHERD_SELECT_WINDOW="0.1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run(cmd, env, **kw):
    return subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize(("args", "expected"), [
    (["3", "--debug", "--max-steps", "2"], "-m supervisor --gpus 3 --debug --max-steps 2"),
    ([], "-m supervisor --gpus 0"),
    (["--debug"], "-m supervisor --gpus 0 --debug"),  # seed: GPU_ID defaults to 0
])
def test_train_gpu_execs_the_supervisor(stub_env, args, expected):
    out = run([TRAIN_GPU, *args], stub_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == f"supervisor argv: {expected}"


@pytest.mark.parametrize("bad", ["abc", "1.5", "GPU0"])
def test_train_gpu_rejects_a_bad_id_with_exit_2(stub_env, bad):
    out = run([TRAIN_GPU, bad, "--debug"], stub_env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"train_gpu.sh: error: GPU id must be a non-negative integer as nvidia-smi shows it, got '{bad}' "
        "(usage: ./train_gpu.sh <gpu_id> [args])"]


def test_help_of_both_scripts(stub_env):
    for script in (TRAIN_GPU, TRAIN_AUTO):
        out = run([script, "--help"], stub_env)
        assert out.returncode == 0 and out.stdout.startswith("Usage: ./train_")


def test_train_auto_gpu_without_gpu_is_exit_2(stub_env):
    # the real machine: no NVIDIA driver here, so NVML cannot load
    out = run([TRAIN_AUTO, "--debug"], stub_env)
    assert out.returncode == 2, out
    assert out.stderr.strip() == "train_auto_gpu.sh: error: no GPU found: libnvidia-ml.so.1 not found (no NVIDIA driver installed)"
    assert "supervisor argv" not in out.stdout


def test_select_gpu_cli_prints_table_and_choice(stub_env, tmp_path):
    m = machine(2)
    m.gpus[0].utilization = 70
    env = subprocess_env(m, tmp_path, stub_env)
    out = run([sys.executable, "-m", "supervisor.commands.select_gpu", "--window", "0.1"], env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:2] == ["GPU", "name"] and lines[1].split()[0] == "1" and "chosen" in lines[1]
    assert lines[-1] == "Using GPU 1 (lowest utilization)"


def test_two_auto_jobs_started_together_get_different_gpus_and_keep_the_claim(stub_env, tmp_path):
    env = subprocess_env(machine(2), tmp_path, dict(stub_env, STUB_SLEEP="1"))
    jobs = [subprocess.Popen([str(TRAIN_AUTO), "--debug"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outs = [job.communicate(timeout=60) for job in jobs]
    chosen = set()
    for job, (stdout, stderr) in zip(jobs, outs, strict=True):
        assert job.returncode == 0, stderr
        lines = stdout.splitlines()
        using = next(line for line in lines if line.startswith("Using GPU"))
        gpu = int(using.split()[2])
        chosen.add(gpu)
        assert using == f"Using GPU {gpu} (lowest utilization)"
        assert f"supervisor argv: -m supervisor --gpus {gpu} --debug" in lines
        pid = next(line for line in lines if line.startswith("pid: ")).split()[1]
        # the run itself (same pid through both execs) still holds the claim the selector took
        assert f"claim holder: {pid}" in lines
    assert chosen == {0, 1}
    third = run([TRAIN_AUTO], env)  # after both ended, their claims are gone
    assert third.returncode == 0 and "Using GPU" in third.stdout


@pytest.mark.skipif(not (REPO / "supervisor" / "__main__.py").exists(), reason="supervisor CLI not merged yet")
def test_train_gpu_without_gpu_is_exit_2_through_the_supervisor(tmp_path):
    env = dict(os.environ, GPUHERD_LOCK_DIR=str(tmp_path / "locks"))
    env.pop("GPUHERD_PYTHON", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = run([TRAIN_GPU, "0", "--debug"], env, cwd=tmp_path)
    assert out.returncode == 2 and "no GPU" in out.stderr and "Traceback" not in out.stderr
