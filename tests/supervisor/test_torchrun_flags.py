"""torchrun's flags with torchrun's meaning (supervisor/torchrun/), the command line each rank
runs, and the environment a script gets."""

from __future__ import annotations

import os
import sys

import pytest

from supervisor.cli import build_parser, parse
from supervisor.processes.worker_env import WRAPPER_PYTHONPATH, script_env
from supervisor.rendezvous import SingleStore
from supervisor.torchrun import BOOTSTRAP, PET, TORCHRUN_FLAGS, Script

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
    # no address flag: a free loopback port, MASTER_ADDR=localhost (torchrun's value then)
    assert parse(["train.py"]).store == SingleStore("127.0.0.1", 0, "localhost")
    assert parse(["--local-addr", "127.0.0.2", "train.py"]).store == SingleStore("127.0.0.2", 0, "127.0.0.2")
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
    launch = parse(["--tee", "3", "-r", "3", "--start-method", "spawn", "--log-dir", "runs",
                    "--duplicate-stdout-filters", "loss", "--logs-specs", "x", "train.py"])
    assert len(launch.notices) == 1 and "no effect here" in launch.notices[0]
    assert "--tee, --redirects, --start-method, --logs-specs, --duplicate-stdout-filters" in launch.notices[0]
    assert launch.config.system.run_root == str(cwd / "runs")


def test_every_flag_of_the_installed_torchruns_parser_is_mapped_or_named_as_no_op(cwd):
    """A torch release that adds a launch flag fails here until gpuherd gives it a meaning."""
    run = pytest.importorskip("torch.distributed.run")
    from torch.distributed.argparse_util import check_env, env

    theirs = [a for a in run.get_args_parser()._actions
              if a.option_strings and a.dest != "help"]
    assert {a.dest for a in theirs} == set(TORCHRUN_FLAGS), "torchrun's flags and gpuherd's table differ"
    assert {a.dest for a in theirs if isinstance(a, (env, check_env))} == PET  # which ones PET_* sets
    ours = build_parser()
    for action in theirs:
        dest = TORCHRUN_FLAGS[action.dest]
        for spelling in action.option_strings:
            found = ours._option_string_actions.get(spelling)
            assert found is not None and found.dest == dest, f"torchrun's {spelling} is not gpuherd's --{dest}"
            assert (found.nargs == 0) == (action.nargs == 0), f"{spelling}: a switch on one side only"
    for action in theirs:
        if action.choices:  # gpuherd accepts every value torchrun accepts (rdzv backends: static, c10d)
            found = ours._option_string_actions[action.option_strings[0]]
            assert found.choices is None or set(action.choices) <= set(found.choices) or \
                action.dest == "rdzv_backend", action.dest


def test_flags_with_torchruns_meaning(cwd):
    launch = parse(["--rdzv-conf", "join_timeout=30,read_timeout=5", "--role", "trainer", "--shutdown-timeout", "7",
                    "--signals-to-handle", "SIGTERM, SIGUSR1", "--virtual-local-rank", "train.py"])
    system, torchrun = launch.config.system, launch.torchrun
    assert (system.rendezvous_timeout, system.grace_period, system.isolate) == (30.0, 7.0, True)
    assert (torchrun.role, torchrun.signals_to_handle, torchrun.virtual_local_rank) == \
        ("trainer", "SIGTERM,SIGUSR1", True)
    assert "read_timeout: no effect here" in launch.notices[0]
    assert parse(["--run-path", "train.py"]).script.run_path


def test_an_elastic_node_range_and_its_last_call(cwd, monkeypatch):
    monkeypatch.setenv("PET_NNODES", "1:3")
    launch = parse(["--node-rank", "2", "--master-addr", "127.0.0.1", "--rdzv-conf", "last_call_timeout=5",
                    "train.py"])
    assert (launch.node.min_nodes, launch.node.nnodes, launch.node.node_rank) == (1, 3, 2) and launch.node.elastic
    assert launch.config.system.rendezvous_last_call == 5.0 and not launch.notices


def test_a_bad_pet_variable_is_one_line_naming_it(cwd, monkeypatch, capsys):
    for name, value, fragment in (("PET_NO_PYTHON", "yes", "PET_NO_PYTHON='yes': expected 0 or 1"),
                                  ("PET_RDZV_BACKEND", "etcd", "PET_RDZV_BACKEND='etcd': expected one of static, c10d"),
                                  ("PET_NNODES", "3:1", "expected 1 <= MIN <= MAX")):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stop:
            parse(["train.py"])
        monkeypatch.delenv(name)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and fragment in err[0], err


@pytest.mark.parametrize("pet, argv, check", [
    ({"PET_NPROC_PER_NODE": "4", "PET_NO_PYTHON": "1"}, ["echo", "x"],
     lambda l: l.config.system.nproc == 4 and l.script.no_python),
    ({"PET_NPROC_PER_NODE": "4"}, ["--nproc-per-node", "3", "train.py"], lambda l: l.config.system.nproc == 3),
    ({"PET_NPROC_PER_NODE": "4"}, ["--nproc", "3", "train.py"], lambda l: l.config.system.nproc == 3),
    ({"PET_NO_PYTHON": "0", "PET_MAX_RESTARTS": "2", "PET_RDZV_ID": "j1", "PET_LOCAL_RANKS_FILTER": "0"},
     ["train.py"], lambda l: (l.script.no_python, l.config.system.max_restarts, l.run_id,
                               l.config.system.log_ranks) == (False, 2, "j1", [0])),
    ({"PET_STANDALONE": "1", "PET_ROLE": "r", "PET_SHUTDOWN_TIMEOUT": "3"}, ["train.py"],
     lambda l: l.store.advertise == "localhost" and l.torchrun.role == "r" and l.config.system.grace_period == 3),
    ({"PET_NUMA_BINDING": "node", "PET_LOGS_SPECS": "x"}, ["train.py"],  # torchrun reads these from flags only
     lambda l: l.torchrun.numa_binding is None and not l.notices),
])
def test_pet_variables_are_the_flags_defaults(cwd, monkeypatch, pet, argv, check):
    for name, value in pet.items():
        monkeypatch.setenv(name, value)
    assert check(parse(argv))


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc-per-node", "0", "train.py"], "--nproc-per-node '0'"),
    (["--nproc", "2", "--nproc-per-node", "2", "train.py"], "give one"),
    (["--nnodes", "1:2", "train.py"], "--nnodes 1:2 needs --master-addr"),
    (["--rdzv-conf", "join_timeout", "train.py"], "expected key=value"),
    (["--rdzv-conf", "join_timeout=soon", "train.py"], "expected seconds"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE", "train.py"], "'SIGNOPE' is not a signal name"),
    (["--numa-binding", "everywhere", "train.py"], "invalid choice"),
    (["--virtual-local-rank", "--no-isolate", "train.py"], "give one"),
    (["--run-path", "-m", "pkg.train"], "--run-path runs a script file"),
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
    # torchrun's macros: ${local_rank} per rank, $$ a dollar; the program itself stays as typed
    assert Script("echo", ["lr=${local_rank}", "$$HOME", "${other}"], no_python=True).command(3) == \
        ["echo", "lr=3", "$HOME", "${other}"]
    assert Script("t_${local_rank}.py", ["--r=${local_rank}"]).command(1)[-2:] == ["t_1.py", "--r=1"]
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py")  # torchrun's override of the interpreter
    assert Script("t.py").command()[0] == "/opt/py"
    assert Script("t.py", run_path=True).command()[0] == py  # torchrun --run-path: its own interpreter


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
