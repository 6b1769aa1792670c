"""Real debug runs for the viewer tests, made once per session (each takes ~30-40 s on CPU).

Offline: the synthetic dataset; every path under one temporary directory.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.supervisor.helpers import env as run_env


def debug_run(cwd: Path, env: dict[str, str], *args: str) -> Path:
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["bash", str(REPO_ROOT / "run_training.sh"), "--debug", "--set", "data.dataset=dummy",
                             "--set", f"data.cache_dir={cwd.parent / 'cache'}", "--report", *args],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (run_dir,) = (cwd / "logs").iterdir()
    return run_dir


@pytest.fixture(scope="session")
def finished_debug_run(tmp_path_factory) -> Path:
    return debug_run(tmp_path_factory.mktemp("runs") / "a", run_env())


@pytest.fixture(scope="session")
def second_debug_run(tmp_path_factory) -> Path:
    """One worker, another learning rate, fewer steps: a run to compare against."""
    return debug_run(tmp_path_factory.mktemp("runs") / "b", run_env(), "--nproc", "1",
                     "--max-steps", "6", "--set", "training.learning_rate=0.001")
