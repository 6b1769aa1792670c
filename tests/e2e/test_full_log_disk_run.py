"""A log disk that fills up never stops the training: with the run directory's disk filled by
another process mid-run, every writer inside the built-in worker (TensorBoard's event thread
among them) drops what it cannot write, says so once, and the run ends as it would have."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson
import pytest

from tests.e2e.helpers import records
from tests.supervisor.helpers import finish, wait_for

pytest.importorskip("tensorboard")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs of its own: filling it fills nobody else's disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk) -> None:
    with open(disk / "ballast", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.mark.parametrize("sink", ["TensorBoard", "W&B offline"])
def test_a_log_disk_filled_mid_run_never_stops_the_built_in_trainer(tmp_path, small_disk, python_env, sink):
    if sink == "W&B offline":
        pytest.importorskip("wandb")
    steps = 40
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--skip-checks", "--nproc", "1", "--run-id", "full"]
    for item in ("system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32",
                 "model.n_layers=1", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16",
                 "training.batch_size=2", f"training.max_steps={steps}", "training.log_every=1",
                 "training.eval_every=0", "training.save_every=0", f"system.run_root={small_disk}"):
        cmd += ["--set", item]
    if sink == "W&B offline":
        cmd += ["--set", "logging.wandb=offline"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run_dir = small_disk / "full"
    try:
        assert wait_for(lambda: proc.poll() is not None or any(r["step"] >= 5 for r in records(run_dir, "step")),
                        timeout=120)
        assert proc.poll() is None, "the run ended before the disk was filled"
        _fill(small_disk)
    finally:
        code, out, err = finish(proc, timeout=180)
    assert code == 0, err[-3000:]
    said = err + out
    assert "Traceback" not in said, said[max(0, said.find("Traceback") - 1500):][:6000]  # whose, and its frames
    warned = [line for line in (out + err).splitlines() if sink in line and "no space left" in line]
    assert len(warned) == 1, (out + err)[-3000:]
    assert (tmp_path / ".checkpoints" / f"step_{steps:07d}.pt").is_file()  # the final save
