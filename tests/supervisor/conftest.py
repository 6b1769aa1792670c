"""Real debug runs for the viewer tests, made once per session and shared by every xdist worker.

Offline: the synthetic dataset, read with the byte tokenizer (a 256-token vocabulary: the views, not
the model's size, are the point; a run is 12 CPU seconds, with GPT-2's 50,304 it was 37); every path
under one temporary directory.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.shared_runs import once_per_session
from tests.supervisor.helpers import env as run_env


def debug_run(cwd: Path, env: dict[str, str], *args: str) -> Path:
    result = subprocess.run(["bash", str(REPO_ROOT / "run_training.sh"), "--debug", "--set", "data.dataset=dummy",
                             "--set", "data.tokenizer=byte", "--set", f"data.cache_dir={cwd.parent / 'cache'}",
                             "--report", *args],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (run_dir,) = (cwd / "logs").iterdir()
    return run_dir


def _shared_run(tmp_path_factory, name: str, *args: str) -> Path:
    """One run for the whole test session, whichever pytest-xdist worker asks first."""
    return once_per_session(tmp_path_factory, name, lambda cwd: debug_run(cwd, run_env(), *args))


@pytest.fixture(scope="session")
def finished_debug_run(tmp_path_factory) -> Path:
    return _shared_run(tmp_path_factory, "a")


@pytest.fixture(scope="session")
def second_debug_run(tmp_path_factory) -> Path:
    """One worker, another learning rate, fewer steps: a run to compare against."""
    return _shared_run(tmp_path_factory, "b", "--nproc", "1", "--max-steps", "6",
                       "--set", "training.learning_rate=0.001")
