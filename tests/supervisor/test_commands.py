"""The `gpuherd` command: one table of subcommands, each with --help, and the installed entry point."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from supervisor.commands import dispatch


def test_help_lists_every_command(capsys):
    assert dispatch.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in dispatch.COMMANDS:
        assert f"\n  {name} " in out


# ids spelt "gpu-command": a bare "gpu" id would read as conftest's GPU-only marker
@pytest.mark.parametrize("name", sorted(dispatch.COMMANDS), ids=lambda name: f"{name.replace(' ', '-')}-command")
def test_every_command_has_help_and_resolves(capsys, name):
    assert callable(dispatch.COMMANDS[name].load())
    try:
        code = dispatch.main([*name.split(), "--help"])
    except SystemExit as stop:  # argparse's --help
        code = stop.code
    assert code == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("argv, fragment", [
    ([], "give a command: run, gpu, auto"),
    (["trian"], "unknown command 'trian'"),
    (["nan"], "did you mean 'nan report' or 'nan replay'?"),
    (["gpu", "x1"], "GPU id must be a non-negative integer as nvidia-smi shows it, got 'x1'"),
])
def test_bad_commands_are_one_line_and_exit_2(capsys, argv, fragment):
    with pytest.raises(SystemExit) as stop:
        dispatch.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_run_passes_its_arguments_to_the_supervisor(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        dispatch.main(["run", "--debug", "--set", "training.batchsize=3"])
    assert stop.value.code == 2 and "did you mean 'training.batch_size'?" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


GPUHERD = os.path.join(os.path.dirname(sys.executable), "gpuherd")  # the console script install.sh makes


@pytest.mark.skipif(not os.path.exists(GPUHERD), reason="gpuherd is not installed in this environment (bash install.sh)")
def test_installed_command_and_module_work_from_any_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # importable because installed
    gpuherd = GPUHERD
    for cmd in ([gpuherd, "--help"], [sys.executable, "-m", "supervisor", "--help"], [gpuherd, "prepare", "--help"]):
        result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0 and "usage: gpuherd" in result.stdout, result.stderr
    dist = importlib.metadata.distribution("gpuherd")
    # the packages it installs (an editable install's in-tree egg-info lists every source
    # file, tests included, in SOURCES.txt: top_level.txt is what is importable)
    top = set((dist.read_text("top_level.txt") or "").split()) or {f.parts[0] for f in dist.files or []}
    assert top == {"gpuherd", "supervisor", "worker", "dataset_cache"}, top
