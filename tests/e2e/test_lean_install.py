"""`pip install gpuherd` alone (the launcher's core, requirements-core.txt) runs a torchrun
script under `gpuherd run`, and a command that needs an extra names it in one line.

A plain venv (no system site packages, so nothing installed elsewhere can stand in for a
missing dependency) gets torch by link from this interpreter's environment (the same
wheel, without a 200 MB install) and then gpuherd from a copy of this checkout by pip,
with the dependencies pyproject.toml declares and nothing else.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from gpuherd.extras import EXTRA_OF_MODULE

pytestmark = [pytest.mark.slow, pytest.mark.network]

PACKAGES = ("gpuherd", "supervisor", "worker", "dataset_cache")
SCRIPT = textwrap.dedent("""\
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} stepped", flush=True)
    dist.destroy_process_group()
""")


def _torch_and_its_requirements() -> list[metadata.Distribution]:
    """torch's distribution and, transitively, those it requires (no extras)."""
    seen: dict[str, metadata.Distribution] = {}
    todo = ["torch"]
    while todo:
        name = todo.pop().lower().replace("_", "-")
        if name in seen:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist
        for req in dist.requires or ():
            if "extra ==" in req:
                continue
            todo.append(re.match(r"[A-Za-z0-9._-]+", req).group(0))
    return list(seen.values())


def _link_torch(site: Path) -> None:
    for dist in _torch_and_its_requirements():
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        base = Path(str(dist.locate_file("")))
        for top in tops:
            if not (site / top).exists() and (base / top).exists():
                (site / top).symlink_to(base / top)


@pytest.fixture(scope="module")
def lean_venv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lean")
    source = root / "src"
    source.mkdir()
    repo = Path(__file__).resolve().parents[2]
    for name in ("pyproject.toml", "README.md", *(p.name for p in repo.glob("requirements*.txt"))):
        shutil.copy2(repo / name, source / name)
    for package in PACKAGES:
        shutil.copytree(repo / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    assert sysconfig.get_paths()["purelib"] != str(site)
    _link_torch(site)
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return venv


def _lean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def test_the_core_alone_has_no_extra(lean_venv):
    python = lean_venv / "bin" / "python"
    for module in EXTRA_OF_MODULE:
        found = subprocess.run([str(python), "-c", f"import importlib.util as u; print(u.find_spec({module!r}))"],
                               capture_output=True, text=True, env=_lean_env())
        assert found.stdout.strip() == "None", f"{module} is installed with the core alone"


def test_gpuherd_run_runs_a_torchrun_script_with_the_core_alone(lean_venv, tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    run = subprocess.run([str(lean_venv / "bin" / "gpuherd"), "run", "--nproc-per-node", "2", "train.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_lean_env())
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "rank 0 of 2 stepped" in out and "rank 1 of 2 stepped" in out
    assert "Traceback" not in out


def test_a_missing_extra_is_one_line_naming_it(lean_venv, tmp_path):
    for argv, extra in ((["run", "--debug"], "train"), (["top", "--once"], "report")):
        run = subprocess.run([str(lean_venv / "bin" / "gpuherd"), *argv], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, env=_lean_env())
        lines = [line for line in run.stderr.splitlines() if "error" in line]
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr and len(lines) == 1, run.stderr
        assert f"pip install 'gpuherd[{extra}]'" in lines[0], lines[0]
    assert not (tmp_path / "logs").exists()  # refused before anything was written
