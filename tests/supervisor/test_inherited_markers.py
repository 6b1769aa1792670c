"""gpuherd's own markers left in the user's shell (issue 43, part 2): with `GPUHERD_STANDBY=1`
exported, `gpuherd run --nproc 2 s.py` ended `2 worker(s) exited 0` with the script never run
(each rank waited as a restart standby for a rank nobody sent); with `GPUHERD_SPARE=1` the
built-in trainer exited 0 having logged none of its losses (each worker waited as a warm spare).
Every marker is dropped from what a worker inherits, and the supervisor names the ones it found."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from gpuherd import contract
from supervisor.gpus import DevicePlan, DeviceSlot
from supervisor.processes import RunEnv, markers_notice, worker_env

SCRIPT = "import os\nprint(f\"script ran as rank {os.environ['RANK']}\", flush=True)\n"
# the built-in trainer at its smallest: a few steps, every one logged, nothing saved or evaluated
TINY = ("system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=1",
        "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
        "training.grad_accum_nums=1", "training.max_steps=4", "training.warmup_steps=1", "training.log_every=1",
        "training.eval_every=0", "training.save_every=0")


def _gpuherd_run(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`gpuherd run ...` (the console script calls this dispatcher)."""
    return subprocess.run([sys.executable, "-m", "supervisor.commands.dispatch", "run", "--no-report", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _warning(err: str) -> list[str]:
    return [line for line in err.splitlines() if "WARNING" in line and "from gpuherd's own environment" in line]


def test_a_worker_inherits_none_of_gpuherds_markers():
    base = {name: "1" for name in contract.INTERNAL_VARS} | {"PATH": "/bin", "GPUHERD_INJECT_BITFLIP": "0:1:param"}
    plan = DevicePlan(slots=(DeviceSlot(0, "cpu", 0),), isolate=False)
    env = worker_env(base, plan, plan.slots[0], RunEnv("r", "/tmp/r", "localhost", 1, 42), 7)
    leaked = {name for name in (contract.STANDBY, contract.SPARE, contract.LIVE_RECOVERY, contract.SHRINK,
                                contract.JOIN_GENERATION, contract.RESUME) if name in env}
    assert leaked == set()
    assert env[contract.STATUS_FD] == "7" and env[contract.SUPERVISOR_PID] == "42"  # its own, not the base's
    assert env["PATH"] == "/bin" and env["GPUHERD_INJECT_BITFLIP"] == "0:1:param"  # user settings pass


def test_the_notice_names_each_marker_and_its_value_in_one_line():
    line = markers_notice({contract.SPARE: "1", contract.STANDBY: "1"})
    assert "\n" not in line and "GPUHERD_SPARE=1, GPUHERD_STANDBY=1" in line and "ignored" in line
    assert markers_notice({}) is None


def test_a_leftover_standby_marker_no_longer_skips_the_script(tmp_path, python_env):
    (tmp_path / "s.py").write_text(SCRIPT)
    r = _gpuherd_run(tmp_path, {**python_env, contract.STANDBY: "1"}, "--set", "system.device=cpu",
                     "--nproc", "2", "s.py")
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "script ran as rank 0" in out and "script ran as rank 1" in out  # it ran, as each rank
    [line] = _warning(r.stderr)
    assert "GPUHERD_STANDBY=1" in line


def test_a_leftover_spare_marker_no_longer_skips_training(tmp_path, python_env):
    args = [item for setting in TINY for item in ("--set", setting)]
    r = _gpuherd_run(tmp_path, {**python_env, contract.SPARE: "1"}, "--debug", "--skip-checks", "--nproc", "2",
                     "--run-id", "m", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [orjson.loads(line) for line in (tmp_path / "logs" / "m" / "metrics.jsonl").read_bytes().splitlines()
             if b'"type":"step"' in line]
    assert sorted({record["step"] for record in steps}) == [0, 1, 2, 3]  # every loss logged
    assert all("loss" in record for record in steps)
    [line] = _warning(r.stderr)
    assert "GPUHERD_SPARE=1" in line


def test_bad_input_with_a_leftover_marker_is_still_one_line_and_nothing_written(tmp_path, python_env):
    r = _gpuherd_run(tmp_path, {**python_env, contract.STANDBY: "1"}, "--set", "system.device=cpu", "missing.py")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["gpuherd: error: script not found: missing.py"]
    assert list(tmp_path.iterdir()) == []
