"""Shared helpers for tests/dataset_cache/: small configs and real builder processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gpuherd.config import DataConfig

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def data_config(tmp_path: Path, **overrides: object) -> DataConfig:
    """A tiny, offline config: 200 dummy documents, byte tokenizer, short context."""
    values: dict[str, object] = {
        "dataset": "dummy", "tokenizer": "byte", "context_length": 32, "num_samples": 200,
        "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache"),
    }
    values.update(overrides)
    return DataConfig(**values)  # type: ignore[arg-type]


# A real builder process. It patches only its own copy of the code: every token
# write prints "WROTE <n>" and then sleeps, so a test can act (SIGKILL it, start
# a rival) at a moment it knows the build is half done.
BUILDER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
from dataset_cache import build, parallel, prepare_cache, writer
from gpuherd.config import DataConfig

delay = float(os.environ.get("TEST_WRITE_DELAY", "0"))
parallel.BATCH_CHARS = build.BATCH_CHARS = 8192  # many small writes instead of one
original = writer.ArrayWriter.append
def slow_append(self, values):
    original(self, values)
    if self.path.name == "tokens.bin":
        print("WROTE", self.count, flush=True)
        time.sleep(delay)
writer.ArrayWriter.append = slow_append
info = prepare_cache(DataConfig(**json.loads(sys.argv[1])), workers=1)
print("INFO", json.dumps({"built": info.built, "key": info.key, "path": str(info.path)}), flush=True)
"""


def start_builder(cfg: DataConfig, write_delay: float) -> subprocess.Popen[str]:
    env = dict(os.environ, TEST_WRITE_DELAY=str(write_delay), PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [PYTHON, "-c", BUILDER, json.dumps(cfg.__dict__), str(ROOT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen[str], prefix: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            raise AssertionError(f"builder exited {proc.returncode} before printing {prefix!r}: {proc.stderr.read()}")
    raise AssertionError(f"builder printed no {prefix!r} line within {timeout} s")


def builder_result(proc: subprocess.Popen[str], timeout: float = 120.0) -> tuple[dict, str]:
    """Wait for a builder; its INFO record and its stderr (the log)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"builder failed ({proc.returncode}): {err}"
    info = next(line for line in out.splitlines() if line.startswith("INFO "))
    return json.loads(info[5:]), err


@contextmanager
def reaped(*procs: subprocess.Popen[str]) -> Iterator[None]:
    """Tests never leave processes behind: kill each builder's whole group at the end."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)


def run_prepare_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """prepare_dataset.py as a user runs it: by path, from another directory."""
    return subprocess.run(
        [PYTHON, str(ROOT / "prepare_dataset.py"), *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env=env,
    )


def capture_loguru():  # noqa: ANN201 (a pytest fixture generator)
    """Messages loguru logs during a test (pytest's caplog does not see loguru)."""
    from loguru import logger

    messages: list[str] = []
    handler = logger.add(lambda message: messages.append(str(message)), level="DEBUG", format="{message}")
    try:
        yield messages
    finally:
        logger.remove(handler)


def dying_encode_batch(batch, dtype_str):  # noqa: ANN001, ANN201 (stands in for parallel._encode_batch)
    """A tokenizer process killed mid-task (as by the OOM killer)."""
    os._exit(137)
