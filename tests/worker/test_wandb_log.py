"""logging.wandb=offline: rank 0 writes a W&B run `wandb sync` can upload, and nothing else happens."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.supervisor.gpus.helpers import captured_log
from tests.supervisor.helpers import env
from worker.wandb_log import WandbLog

WRITE = """
from pathlib import Path
import sys
from worker.wandb_log import WandbLog
log = WandbLog("offline", Path(sys.argv[1]), 0, {"training": {"learning_rate": 3e-4}})
for step in range(3):
    log.scalars(step, **{"train/loss": 3.0 - step, "perf/mfu": None})
log.close()
"""


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed (optional)")
def test_rank_0_writes_an_offline_run_that_wandb_sync_would_upload(tmp_path):
    run_dir = tmp_path / "20261123-011732-2ac3"
    run_dir.mkdir()
    child = env()
    child.update(WANDB_MODE="online", WANDB_BASE_URL="http://127.0.0.1:9", WANDB_API_KEY="x" * 40)  # must not matter
    # a child process: wandb's service process lives as long as the interpreter that started it
    result = subprocess.run([sys.executable, "-c", WRITE, str(run_dir)], env=child, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    (offline,) = (run_dir / "wandb").glob("offline-run-*-20261123-011732-2ac3-attempt0")
    (records,) = offline.glob("run-*.wandb")
    assert records.read_bytes().count(b"train/loss") >= 3
    listed = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run"], cwd=run_dir, env=child,
                            capture_output=True, text=True, timeout=120)
    assert "Would sync 1 run(s)" in listed.stdout + listed.stderr


def test_other_ranks_and_off_write_nothing(tmp_path):
    for log in (WandbLog("offline", tmp_path, 1), WandbLog("off", tmp_path, 0)):
        log.scalars(0, loss=1.0)
        log.close()
    assert list(tmp_path.iterdir()) == []


def test_without_wandb_installed_it_warns_once_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with captured_log() as messages:
        log = WandbLog("offline", tmp_path, 0)
    log.scalars(0, loss=1.0)
    assert messages == ["logging.wandb=offline but wandb is not installed (pip install wandb): no W&B run"]
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="logging.wandb='online': expected one of off, offline"):
        WandbLog("online", None, 0)
