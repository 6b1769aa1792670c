"""A torch older than the trainer's floor is one line and exit 2 at every entry point,
before anything is written (real processes with a faked older torch)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuherd.torch_floor import FLOOR_TEXT, TorchTooOld, check_torch_version, parse_version


@pytest.mark.parametrize("version, parsed", [
    ("2.6.0+cu124", (2, 6)), ("2.7.0a0+git1234abc", (2, 7)), ("2.13.0", (2, 13)), ("garbage", None),
])
def test_versions_parse_as_major_minor(version: str, parsed):
    assert parse_version(version) == parsed


def test_the_floor_is_2_7():
    for ok in ("2.7.0", "2.7.1+cu126", "2.13.0+cpu", "3.0.0"):
        check_torch_version(ok)
    for old in ("2.4.1", "2.6.0+cu124", "1.13.1"):
        with pytest.raises(TorchTooOld, match=re.escape(f"torch {old} is too old: gpuherd's trainer needs torch >= {FLOOR_TEXT}")) as err:
            check_torch_version(old)
        assert err.value.exit_code == 2 and "\n" not in str(err.value)
    with pytest.raises(TorchTooOld, match="torch is not installed"):
        check_torch_version(None)


def test_install_sh_asks_the_same_module(repo_root: Path, python_env):
    old = subprocess.run([sys.executable, "-m", "gpuherd.torch_floor", "2.5.1"], env=python_env,
                         capture_output=True, text=True, timeout=60)
    assert old.returncode == 1 and old.stdout.startswith("torch 2.5.1 is too old")
    new = subprocess.run([sys.executable, "-m", "gpuherd.torch_floor", "2.13.0"], env=python_env,
                         capture_output=True, text=True, timeout=60)
    assert new.returncode == 0 and new.stdout == ""
    assert "python\" -m gpuherd.torch_floor" in (repo_root / "install.sh").read_text().replace("$PY", "python")


@pytest.fixture
def old_torch(tmp_path: Path, python_env: dict[str, str]) -> dict[str, str]:
    """An environment whose torch says it is 2.4.0: the imported module (a sitecustomize
    patches __version__) and the installed metadata (a dist-info found first on the path)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.4.0'\n")
    dist = site / "torch-2.4.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.4.0\n")
    env = dict(python_env)
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    return env


@pytest.mark.parametrize("entry", ["supervisor", "pretrain_main"])
def test_entry_points_refuse_an_old_torch_with_one_line(entry: str, repo_root: Path, tmp_path: Path, old_torch):
    work = tmp_path / "work"
    work.mkdir()
    cmd = ([sys.executable, "-m", "supervisor", "--debug", "--nproc", "1", "--set", "system.device=cpu"]
           if entry == "supervisor" else [sys.executable, str(repo_root / "pretrain_main.py"), "--debug"])
    done = subprocess.run(cmd, cwd=work, env=old_torch, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "too old" in line]
    assert len(errors) == 1 and "torch 2.4.0 is too old" in errors[0] and "Traceback" not in done.stderr
    assert not list(work.iterdir())  # no logs/, no cache/, nothing
