"""Real debug runs for the viewer tests, made once per session and shared by every xdist worker
(each takes ~30-40 s on CPU).

Offline: the synthetic dataset; every path under one temporary directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from filelock import FileLock

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


def _shared_run(tmp_path_factory, name: str, *args: str) -> Path:
    """One run for the whole test session, whichever pytest-xdist worker asks first: the others
    wait for it under a file lock and read the same run (a debug run is 30-40 s of both cores)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # every worker's common parent
    cwd = shared / f"shared-run-{name}" / "w"  # its dataset cache beside it, in shared-run-{name}/cache
    cwd.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(shared / f"shared-run-{name}.lock")):
        done = cwd / "done"
        if not done.exists():
            shutil.rmtree(cwd, ignore_errors=True)  # a worker that failed half-way left it
            run_dir = debug_run(cwd, run_env(), *args)
            done.write_text(run_dir.name)
        return cwd / "logs" / done.read_text()


@pytest.fixture(scope="session")
def finished_debug_run(tmp_path_factory) -> Path:
    return _shared_run(tmp_path_factory, "a")


@pytest.fixture(scope="session")
def second_debug_run(tmp_path_factory) -> Path:
    """One worker, another learning rate, fewer steps: a run to compare against."""
    return _shared_run(tmp_path_factory, "b", "--nproc", "1", "--max-steps", "6",
                       "--set", "training.learning_rate=0.001")
