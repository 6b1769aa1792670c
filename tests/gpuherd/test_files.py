"""Atomic writes: files follow the user's umask like any tool's, and a temp file says
whose it is and whether its writer is still alive (real processes, real locks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuherd.files import atomic_file, held_by_nobody, locked_temp_dir, write_bytes_atomic

REPO = Path(__file__).resolve().parents[2]

# Opens an atomic write and stops halfway, as a writer killed (or still busy) mid-save.
HALF_WRITTEN = """
import sys, time
from pathlib import Path
from gpuherd.files import atomic_file

with atomic_file(Path(sys.argv[1]), label="run-x") as handle:
    handle.write(b"half")
    print("writing", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_files_follow_the_umask(tmp_path: Path, umask: int, mode: int):
    old = os.umask(umask)
    try:
        write_bytes_atomic(tmp_path / "summary.json", b"{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "summary.json").read_bytes() == b"{}\n"
    assert oct((tmp_path / "summary.json").stat().st_mode & 0o777) == oct(mode)


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path: Path):
    target = tmp_path / "config.json"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_file(target) as handle:
        handle.write(b"new, half")
        raise RuntimeError("disk trouble")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_a_temp_file_names_its_writer_and_is_held_until_the_writer_dies(tmp_path: Path):
    target = tmp_path / "step_0000001.pt"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", HALF_WRITTEN, str(target)], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        (tmp,) = tmp_path.iterdir()
        assert tmp.name.startswith(f".step_0000001.pt.run-x.{proc.pid}.") and tmp.name.endswith(".tmp")
        assert not held_by_nobody(tmp)  # a live writer holds it
        assert not target.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert held_by_nobody(tmp)  # the kernel dropped the dead writer's lock
    assert not target.exists()


def test_a_locked_temp_dir_is_held_while_filled_and_removed_on_error(tmp_path: Path):
    with locked_temp_dir(tmp_path / "step_0000002", label="run-x") as tmp:
        assert tmp.is_dir() and tmp.name.startswith(f".step_0000002.run-x.{os.getpid()}.")
        assert not held_by_nobody(tmp)
        os.replace(tmp, tmp_path / "step_0000002")
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000002"]
    with pytest.raises(OSError), locked_temp_dir(tmp_path / "step_0000003") as tmp:
        (tmp / "shard").write_bytes(b"x")
        raise OSError(28, "No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["step_0000002"]
