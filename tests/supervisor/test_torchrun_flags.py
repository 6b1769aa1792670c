"""torchrun's flags with torchrun's meaning (supervisor/torchrun/), the command line each rank
runs, and the environment a script gets."""

from __future__ import annotations

import os
import sys

import pytest

from supervisor.cli import parse
from supervisor.processes.worker_env import WRAPPER_PYTHONPATH, script_env
from supervisor.rendezvous import SingleStore
from supervisor.torchrun import BOOTSTRAP, Script

CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return tmp_path


@pytest.mark.parametrize("flags, device, nproc, explicit", [
    (["--nproc-per-node", "3"], "auto", 3, True),
    (["--nproc_per_node=4"], "auto", 4, True),
    (["--nproc-per-node", "gpu"], "cuda", 2, False),  # every usable GPU; none is exit 2 at planning
    (["--nproc-per-node", "cpu"], "cpu", CORES, False),
    (["--nproc-per-node", "auto"], "auto", CORES, False),  # every GPU, else one worker per core
])
def test_nproc_per_node(cwd, flags, device, nproc, explicit):
    launch = parse([*flags, "train.py"])
    assert (launch.config.system.device, launch.config.system.nproc, launch.nproc_explicit) == \
        (device, nproc, explicit)


def test_shared_flags_in_torchruns_spellings(cwd):
    launch = parse(["--nnodes=1:1", "--node_rank", "0", "--max_restarts", "2", "--rdzv_id", "job7",
                    "--local_ranks_filter", "0", "train.py", "--lr", "1"])
    assert launch.config.system.max_restarts == 2 and launch.config.system.log_ranks == [0]
    assert launch.run_id == "job7" and launch.node.nnodes == 1
    assert (launch.script.target, launch.script.args) == ("train.py", ["--lr", "1"])


def test_where_the_store_listens_on_one_node(cwd):
    assert parse(["train.py"]).store is None  # a free loopback port the supervisor binds itself
    assert parse(["--standalone", "train.py"]).store == SingleStore("127.0.0.1", 0, "localhost")
    assert parse(["--master-addr", "localhost", "--master-port", "29511", "train.py"]).store == \
        SingleStore("localhost", 29511, "localhost")
    assert parse(["--master_port", "29512", "train.py"]).store == SingleStore("127.0.0.1", 29512, "127.0.0.1")
    assert parse(["--rdzv-endpoint", "127.0.0.1:29513", "--rdzv-backend", "c10d", "train.py"]).store == \
        SingleStore("127.0.0.1", 29513, "127.0.0.1")
    standalone = parse(["--standalone", "--master-port", "1", "train.py"])
    assert standalone.store.port == 0 and "ignored" in standalone.notices[0]


def test_multi_node_flags_reach_the_node_spec(cwd):
    launch = parse(["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:29400", "train.py"])
    assert (launch.node.nnodes, launch.node.node_rank, launch.node.master_addr, launch.node.master_port) == \
        (2, 1, "10.0.0.1", 29400)
    assert launch.store is None  # node 0's agent hosts it


def test_flags_gpuherd_does_anyway_are_accepted_and_named_once(cwd):
    launch = parse(["--tee", "3", "-r", "3", "--start-method", "spawn", "--log-dir", "runs", "train.py"])
    assert len(launch.notices) == 1 and "--tee, --redirects, --start-method" in launch.notices[0]
    assert launch.config.system.run_root == str(cwd / "runs")


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc-per-node", "0", "train.py"], "--nproc-per-node '0'"),
    (["--nproc", "2", "--nproc-per-node", "2", "train.py"], "give one"),
    (["--nnodes", "1:2", "train.py"], "elastic node ranges are not supported"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--master-addr", "h", "train.py"], "--node-rank"),
    (["-m", "--no-python", "pkg.train"], "-m and --no-python cannot be combined"),
    (["--no-python", "no-such-program-here"], "not an executable program"),
    (["--no-auto-heartbeat"], "--no-auto-heartbeat needs a script"),
    (["missing.py"], "script not found: missing.py"),
    (["train.py", "--script", "x"], None),  # the script's own --script: fine
    (["--script"], "--script needs a path"),
])
def test_bad_torchrun_flags_are_one_line_exit_2(cwd, capsys, argv, fragment):
    if fragment is None:
        assert parse(argv).script.args == ["--script", "x"]
        return
    with pytest.raises(SystemExit) as stop:
        parse(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_each_rank_runs_the_script_as_torchrun_would_through_the_bootstrap(monkeypatch):
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    py = sys.executable
    assert Script("t.py", ["--x"]).command() == [py, "-u", str(BOOTSTRAP), "t.py", "--x"]
    assert Script("pkg.t", ["a"], module=True).command() == [py, "-u", str(BOOTSTRAP), "-m", "pkg.t", "a"]
    assert Script("t.py", ["--x"], auto_heartbeat=False).command() == [py, "-u", "t.py", "--x"]  # = torchrun
    assert Script("./run.sh", ["a"], no_python=True).command() == ["./run.sh", "a"]
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py")  # torchrun's override of the interpreter
    assert Script("t.py").command()[0] == "/opt/py"


@pytest.mark.parametrize("before, after", [
    ("/repo", None),  # the user had none
    ("/repo:/mine:/also", "/mine:/also"),
    ("/repo:/repo:/mine", "/repo:/mine"),  # the user's own copy of the same entry stays
])
def test_a_script_gets_the_users_pythonpath_back(monkeypatch, before, after):
    monkeypatch.setenv(WRAPPER_PYTHONPATH, "/repo")
    monkeypatch.setenv("PYTHONPATH", before)
    env = script_env()
    assert env.get("PYTHONPATH") == after and WRAPPER_PYTHONPATH not in env


def test_without_the_wrapper_the_environment_is_untouched(monkeypatch):
    monkeypatch.delenv(WRAPPER_PYTHONPATH, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/repo:/mine")
    assert script_env()["PYTHONPATH"] == "/repo:/mine"
