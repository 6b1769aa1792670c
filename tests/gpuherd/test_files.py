"""gpuherd/files.py: atomic writes that give the file the permissions the user's umask says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuherd.files import current_umask, write_bytes_atomic


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_follow_the_umask(tmp_path, repo_root, umask, mode):
    """In a child process, so the test process's own umask is never changed."""
    code = ("import sys; from pathlib import Path; from gpuherd.files import current_umask, write_bytes_atomic; "
            "write_bytes_atomic(Path(sys.argv[1]), b'x'); print(oct(current_umask()))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "f")], cwd=repo_root, capture_output=True,
                          text=True, timeout=60, preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == oct(umask)
    assert (tmp_path / "f").stat().st_mode & 0o777 == mode
    assert [p.name for p in tmp_path.iterdir()] == ["f"]  # no temp file left


def test_reading_the_umask_leaves_it_alone(tmp_path):
    before = current_umask()
    write_bytes_atomic(tmp_path / "g", b"y")
    assert current_umask() == before and (tmp_path / "g").read_bytes() == b"y"
