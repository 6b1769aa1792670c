"""Every command a user types: bad config -> exit 2, one line, nothing written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

COMMANDS = {
    "run_training.sh": ["bash", "{root}/run_training.sh"],
    "train_gpu.sh": ["bash", "{root}/train_gpu.sh", "0"],
    "train_auto_gpu.sh": ["bash", "{root}/train_auto_gpu.sh"],
    "pretrain_main.py": ["{python}", "{root}/pretrain_main.py"],
    "prepare_dataset.py": ["{python}", "{root}/prepare_dataset.py"],
    # the `gpuherd` command (the console script calls the same dispatcher)
    "gpuherd run": ["{python}", "-m", "supervisor.commands.dispatch", "run"],
    "gpuherd gpu": ["{python}", "-m", "supervisor.commands.dispatch", "gpu", "0"],
    "gpuherd prepare": ["{python}", "-m", "supervisor.commands.dispatch", "prepare"],
}
# The GPU scripts may refuse for lack of a GPU before reading the config; both are exit 2.
NAMES_THE_KEY = {"run_training.sh", "pretrain_main.py", "prepare_dataset.py", "gpuherd run", "gpuherd prepare"}


def _run(name: str, args: list[str], cwd: Path, repo_root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [part.format(root=repo_root, python=env["GPUHERD_PYTHON"]) for part in COMMANDS[name]]
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(COMMANDS))
@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--debug", "--set", "training.batchsize=3"], "did you mean 'training.batch_size'?"),
        (["--debug", "--config", "missing.json"], "config file not found"),
        (["--debug", "--max-steps", "-5"], "training.max_steps must be > 0"),
        (["--debug", "--set", "model.dim=130"], "must be divisible by model.n_heads"),
        (["--preset", "nope"], "invalid choice"),
    ],
)
def test_bad_config_exits_2_with_one_line_and_writes_nothing(name, args, fragment, tmp_path, repo_root, python_env):
    if not name.startswith("gpuherd") and not (repo_root / COMMANDS[name][1].split("/")[-1]).exists():
        pytest.fail(f"{name} is missing from the repo root")
    result = _run(name, args, tmp_path, repo_root, python_env)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    if name in NAMES_THE_KEY:
        assert fragment in lines[0]
    assert list(tmp_path.iterdir()) == [], "a bad config must not write anything"
