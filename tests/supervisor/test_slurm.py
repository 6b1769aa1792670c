"""SLURM: reading an allocation from the environment (supervisor/rendezvous/slurm_env.py) and
writing the sbatch script (python -m supervisor.commands.sbatch). No SLURM needed: the
environment is a dict and scontrol is a small shell script put first on PATH."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.commands import sbatch as slurm
from supervisor.commands.sbatch import SbatchOptions, render_sbatch
from supervisor.rendezvous import slurm_env
from supervisor.rendezvous.slurm_env import SlurmError, SlurmNode, derived_port, hostnames, read_slurm
from tests.supervisor import helpers as sh

# What srun puts in the environment of the task on the second of two nodes.
STEP_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_GPUS_ON_NODE": "4",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}

FAKE_SCONTROL = """#!/bin/sh
# Knows one hostlist, like a cluster with nodes node01 and node02.
if [ "$1 $2 $3" = "show hostnames node[01-02]" ]; then
  echo node01
  echo node02
  exit 0
fi
if [ "$3" = "slow[1-2]" ]; then
  exec sleep 5
fi
echo "scontrol: error: Invalid hostlist: $3" >&2
exit 1
"""


def fake_hostnames(nodelist: str) -> list[str]:
    assert nodelist == "node[01-02]"
    return ["node01", "node02"]


def env(**changes: str | None) -> dict[str, str]:
    """STEP_ENV with some variables changed; None removes one."""
    out = dict(STEP_ENV)
    for name, value in changes.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def batch_env() -> dict[str, str]:
    """The batch script's own environment: job-level variables only, no step."""
    return env(SLURM_STEP_NUM_NODES=None, SLURM_STEP_NODELIST=None, SLURM_STEP_TASKS_PER_NODE=None, SLURM_NODEID="0")


@pytest.fixture
def scontrol_on_path(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(FAKE_SCONTROL)
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return script


@pytest.fixture
def no_scontrol(tmp_path, monkeypatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


# ---- read_slurm: a complete allocation

def test_complete_allocation():
    node = read_slurm(STEP_ENV, hostnames=fake_hostnames)
    assert node == SlurmNode(job_id="4242", nnodes=2, node_rank=1, master_addr="node01", master_port=24242,
                             hosts=("node01", "node02"), gpus_on_node=4, cuda_visible_devices="0,1,2,3")


def test_batch_step_uses_job_level_variables():
    node = read_slurm(batch_env(), hostnames=fake_hostnames)
    assert (node.nnodes, node.node_rank, node.master_addr) == (2, 0, "node01")


def test_alternative_names_for_node_count_and_list():
    only = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_NODELIST": "node[01-02]"}
    node = read_slurm(only, hostnames=fake_hostnames)
    assert (node.nnodes, node.hosts, node.gpus_on_node, node.cuda_visible_devices) == \
        (2, ("node01", "node02"), None, None)


def test_step_variables_win_over_the_jobs():
    """A step on part of the allocation: SLURM_NODEID counts the step's nodes, so must the rest."""
    node = read_slurm(env(SLURM_JOB_NUM_NODES="4", SLURM_NNODES="4", SLURM_JOB_NODELIST="node[01-04]"),
                      hostnames=fake_hostnames)
    assert (node.nnodes, node.hosts) == (2, ("node01", "node02"))


def test_plain_node_list_needs_no_scontrol():
    def never(nodelist):
        raise AssertionError("scontrol must not be asked about a list without brackets")

    node = read_slurm(env(SLURM_STEP_NODELIST="gpu-a,gpu-b"), hostnames=never)
    assert node.hosts == ("gpu-a", "gpu-b") and node.master_addr == "gpu-a"


def test_explicit_master_addr_skips_the_node_list(no_scontrol):
    node = read_slurm(env(SLURM_STEP_NODELIST="odd[1-2]"), master_addr="10.0.0.5")
    assert (node.master_addr, node.hosts, node.node_rank) == ("10.0.0.5", (), 1)


def test_stale_master_addr_in_the_environment_is_ignored():
    assert read_slurm(env(MASTER_ADDR="localhost"), hostnames=fake_hostnames).master_addr == "node01"


# ---- read_slurm: missing and bad variables, one line naming the variable

@pytest.mark.parametrize(("changes", "message"), [
    ({"SLURM_JOB_ID": None}, "not inside a SLURM allocation: SLURM_JOB_ID is not set"),
    ({"SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set"),
    ({"SLURM_NODEID": None}, "SLURM_NODEID is not set"),
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x' is not an integer"),
    ({"SLURM_NODEID": "-1"}, "SLURM_NODEID='-1' is not an integer"),
    ({"SLURM_NODEID": "²"}, "SLURM_NODEID='²' is not an integer"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 but SLURM_STEP_NUM_NODES=2"),
    ({"SLURM_NODEID": "2"}, "node ids run from 0 to 1"),
    ({"SLURM_STEP_NUM_NODES": "0"}, "SLURM_STEP_NUM_NODES=0 is out of range: it must be at least 1"),
    ({"SLURM_STEP_NUM_NODES": "+2"}, "SLURM_STEP_NUM_NODES='+2' is not an integer"),
    ({"SLURM_STEP_NUM_NODES": None, "SLURM_NNODES": None, "SLURM_JOB_NUM_NODES": None},
     "none of SLURM_STEP_NUM_NODES, SLURM_NNODES, SLURM_JOB_NUM_NODES is set"),
    ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None},
     "none of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST is set"),
    ({"SLURM_STEP_NODELIST": "a,b,c"}, "SLURM_STEP_NODELIST='a,b,c' names 3 host(s) but SLURM_STEP_NUM_NODES=2"),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)"}, "SLURM_STEP_TASKS_PER_NODE='8(x2)': gpuherd runs one supervisor per node"),
    ({"SLURM_STEP_TASKS_PER_NODE": "1,?"}, "SLURM_STEP_TASKS_PER_NODE='1,?' is not a task layout"),
])
def test_bad_allocation_is_one_line_naming_the_variable(changes, message):
    with pytest.raises(SlurmError) as err:
        read_slurm(env(**changes), hostnames=fake_hostnames)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# ---- master port

def test_master_port_from_the_environment_wins():
    assert read_slurm(env(MASTER_PORT="29555"), hostnames=fake_hostnames).master_port == 29555


def test_empty_master_port_means_unset():
    assert read_slurm(env(MASTER_PORT=""), hostnames=fake_hostnames).master_port == 24242


@pytest.mark.parametrize("value", ["0", "65536", "http", "29500.0"])
def test_bad_master_port_is_an_error_not_ignored(value):
    with pytest.raises(SlurmError, match="MASTER_PORT="):
        read_slurm(env(MASTER_PORT=value), hostnames=fake_hostnames)


def test_derived_port_is_the_same_on_every_node_and_stays_below_the_ephemeral_range():
    ports = {read_slurm(env(SLURM_NODEID=str(rank)), hostnames=fake_hostnames).master_port for rank in (0, 1)}
    assert ports == {24242}
    for job_id in ("0", "9999", "10000", "123456789"):
        assert 20000 <= derived_port(job_id) < 30000 < 32768
    assert derived_port("1") != derived_port("2")


def test_non_numeric_job_id_needs_master_port():
    with pytest.raises(SlurmError, match=r"SLURM_JOB_ID='abc' is not an integer.*set MASTER_PORT"):
        read_slurm(env(SLURM_JOB_ID="abc"), hostnames=fake_hostnames)
    assert read_slurm(env(SLURM_JOB_ID="abc", MASTER_PORT="20001"), hostnames=fake_hostnames).master_port == 20001


# ---- GPUs on this node

@pytest.mark.parametrize(("changes", "expected"), [
    ({"SLURM_GPUS_ON_NODE": "4"}, 4),
    ({"SLURM_GPUS_ON_NODE": "0"}, 0),
    ({"SLURM_GPUS_ON_NODE": None}, None),
    ({"SLURM_GPUS_ON_NODE": ""}, None),
    ({"SLURM_GPUS_ON_NODE": None, "SLURM_GPUS_PER_NODE": "8"}, 8),
    ({"SLURM_GPUS_ON_NODE": None, "SLURM_GPUS_PER_NODE": "a100:4"}, 4),
    ({"SLURM_GPUS_ON_NODE": None, "SLURM_GPUS_PER_NODE": "gpu:a100:2"}, 2),
    ({"SLURM_GPUS_ON_NODE": None, "SLURM_GPUS_PER_NODE": "volta:3,kepler:1"}, 4),
    ({"SLURM_GPUS_ON_NODE": "2", "SLURM_GPUS_PER_NODE": "a100:4"}, 2),  # what this node got wins
])
def test_gpu_count_forms(changes, expected):
    assert read_slurm(env(**changes), hostnames=fake_hostnames).gpus_on_node == expected


@pytest.mark.parametrize(("name", "value"), [("SLURM_GPUS_ON_NODE", "four"), ("SLURM_GPUS_PER_NODE", "a100:")])
def test_bad_gpu_count_names_the_variable(name, value):
    with pytest.raises(SlurmError, match=f"{name}='{value}' is not a GPU count"):
        read_slurm(env(**{"SLURM_GPUS_ON_NODE": None, name: value}), hostnames=fake_hostnames)


def test_cuda_visible_devices_is_passed_through_as_slurm_set_it():
    assert read_slurm(env(CUDA_VISIBLE_DEVICES="GPU-1a2b,GPU-3c4d"), hostnames=fake_hostnames) \
        .cuda_visible_devices == "GPU-1a2b,GPU-3c4d"
    assert read_slurm(env(CUDA_VISIBLE_DEVICES=None), hostnames=fake_hostnames).cuda_visible_devices is None


# ---- hostnames: the real scontrol call, against a fake scontrol

def test_hostnames_runs_scontrol(scontrol_on_path):
    assert hostnames("node[01-02]") == ["node01", "node02"]


def test_read_slurm_expands_through_scontrol_by_default(scontrol_on_path):
    assert read_slurm(batch_env()).hosts == ("node01", "node02")


def test_failing_scontrol_says_so_and_suggests_master_addr(scontrol_on_path):
    with pytest.raises(SlurmError) as err:
        read_slurm(env(SLURM_STEP_NODELIST="bad[1-2]"))
    message = str(err.value)
    assert message.startswith("cannot expand SLURM_STEP_NODELIST='bad[1-2]': scontrol show hostnames failed")
    assert "Invalid hostlist: bad[1-2]" in message and "--master-addr" in message and "\n" not in message


def test_missing_scontrol_says_so_and_suggests_master_addr(no_scontrol):
    with pytest.raises(SlurmError, match=r"scontrol is not on PATH; pass --master-addr HOST explicitly"):
        hostnames("node[01-02]")
    with pytest.raises(SlurmError, match=r"^cannot expand SLURM_STEP_NODELIST='node\[01-02\]': scontrol is not"):
        read_slurm(STEP_ENV)


def test_hung_scontrol_times_out(scontrol_on_path, monkeypatch):
    monkeypatch.setattr(slurm_env, "SCONTROL_TIMEOUT_S", 0.2)
    with pytest.raises(SlurmError, match=r"did not answer within 0.2 s; pass --master-addr"):
        hostnames("slow[1-2]")


# ---- the sbatch script: render_sbatch

def options(**changes) -> SbatchOptions:
    base = SbatchOptions(nodes=2, gpus_per_node=8, cpus_per_task=64, repo=Path("/srv/my checkout/gpuherd"),
                         log_dir=Path("/srv/logs/slurm"), time="48:00:00", partition="gpu",
                         train_args=TRAIN_ARGS)
    return dataclasses.replace(base, **changes)


# Arguments a shell must not re-interpret: spaces, quotes, $(...), ;, glob characters.
TRAIN_ARGS = ("--preset", "gpt2-small", "--set", "training.max_steps=1000", "--set",
              "data.dataset=/data/my corpus's $(touch pwned); *.txt")


def directives(script: str) -> dict[str, str]:
    found = [(line.removeprefix("#SBATCH --").split("=", 1) + [""])[:2] for line in script.splitlines()
             if line.startswith("#SBATCH")]
    return dict(found)  # a flag without a value (--requeue): ""


def test_sbatch_directives_one_task_per_node_and_the_gpus():
    assert directives(render_sbatch(options())) == {
        "job-name": "gpuherd", "nodes": "2", "ntasks-per-node": "1", "gres": "gpu:8", "cpus-per-task": "64",
        "time": "48:00:00", "partition": "gpu",
        "output": "/srv/logs/slurm/%x-%j.out", "error": "/srv/logs/slurm/%x-%j.out", "open-mode": "append",
        "signal": "USR1@180",
    }


def test_cpu_job_asks_for_no_gpu_and_starts_its_cpu_workers():
    """A cluster without GRES rejects any --gres=gpu line; --requeue only when asked for."""
    script = render_sbatch(options(gpus_per_node=0, cpu_workers=2, cpus_per_task=4, requeue=True))
    found = directives(script)
    assert "gres" not in found and found["requeue"] == "" and found["open-mode"] == "append"
    assert "# gpuherd: 2 node(s) x 2 CPU worker(s)" in script
    assert shlex.split(script.splitlines()[-1])[:9] == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "bash", "run_training.sh", "--slurm", "--nproc", "2",
        "--preset"]
    assert "requeue" not in directives(render_sbatch(options()))


@pytest.mark.parametrize("args", [["--gpus-per-node", "0"], ["--cpu"]])
def test_cli_cpu_job(args):
    opts, _ = slurm.parse(["--nodes", "3", *args, "--cpu-workers", "2", "--log-dir", "/tmp/l"])
    assert (opts.gpus_per_node, opts.cpu_workers, opts.cpus_per_task) == (0, 2, 4)  # 2 CPUs per CPU worker


@pytest.mark.parametrize(("args", "message"), [
    (["--cpu", "--gpus-per-node", "4"], "--cpu and --gpus-per-node 4 contradict each other"),
    (["--gpus-per-node", "4", "--cpu-workers", "2"], "--cpu-workers is for CPU-only nodes"),
    ([], "the following arguments are required: --gpus-per-node (0, or --cpu, for CPU-only nodes)"),
])
def test_cli_cpu_flags_that_do_not_fit(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        slurm.parse(["--nodes", "2", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1


def test_spare_nodes_are_allocated_beyond_the_training_nodes_which_are_named_explicitly():
    """SLURM's node count is every node allocated: the supervisor is told which of them train."""
    opts, _ = slurm.parse(["--nodes", "2", "--gpus-per-node", "8", "--spare-nodes", "1", "--log-dir", "/tmp/l",
                           "--", "--max-restarts", "3"])
    script = render_sbatch(opts)
    assert directives(script)["nodes"] == "3" and "and 1 spare node(s) (SLURM_NODEID 2 and up" in script
    assert shlex.split(script.splitlines()[-1])[6:] == ["--run-id", opts.run_id, "--nnodes", "2", "--spare-nodes", "1",
                                                        "--max-restarts", "3"]
    assert "--spare-nodes" not in render_sbatch(options())


def test_optional_directives_only_when_given():
    found = directives(render_sbatch(options(time=None, partition=None, account="proj7", mem="0")))
    assert "time" not in found and "partition" not in found
    assert (found["account"], found["mem"]) == ("proj7", "0")
    assert "signal" not in directives(render_sbatch(options(stop_warning=0)))


def test_every_directive_comes_before_the_first_command():
    """sbatch stops reading #SBATCH lines at the first line that is not a comment."""
    lines = render_sbatch(options()).splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert lines[0] == "#!/bin/bash"


def test_srun_line_quotes_the_training_arguments():
    script = render_sbatch(options())
    srun = script.splitlines()[-1]
    assert srun.startswith("srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash run_training.sh --slurm --preset ")
    assert shlex.split(srun)[6:] == list(TRAIN_ARGS)
    assert "cd '/srv/my checkout/gpuherd'" in script.splitlines()


def test_nccl_settings_and_hints():
    script = render_sbatch(options())
    for line in ('export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"', "# export NCCL_SOCKET_IFNAME=eth0",
                 "# export GLOO_SOCKET_IFNAME=eth0", "# export NCCL_IB_DISABLE=1",
                 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"'):
        assert line in script.splitlines()
    # torch's default (3) stays: forcing 1 makes a failed collective call ncclCommAbort, which can hang
    assert "ASYNC_ERROR_HANDLING=" not in script.replace("TORCH_NCCL_ASYNC_ERROR_HANDLING=3", "")
    assert "Out of memory" in script and "a rank never joined" in script


def test_script_is_valid_bash(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(render_sbatch(options()))
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr


FAKE_SRUN = """#!/bin/bash
# Records what srun was asked to run, and the environment it would pass on.
printf '%s\\n' "$PWD" "$@" > "$RECORD.args"
env | grep -E '^(NCCL_|TORCH_NCCL_|SRUN_CPUS_PER_TASK=)' | sort > "$RECORD.env"
"""


def test_script_runs_srun_with_the_arguments_intact(tmp_path):
    """Run the generated script under bash with a fake srun: arguments arrive unchanged, nothing is expanded."""
    repo = tmp_path / "my checkout"
    repo.mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(FAKE_SRUN)
    (tmp_path / "bin" / "srun").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(options(repo=repo)))
    job_env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "RECORD": str(tmp_path / "srun"),
               "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node[01-02]",
               "SLURM_CPUS_PER_TASK": "64", "NCCL_DEBUG": "INFO"}
    done = subprocess.run(["bash", str(script)], cwd=tmp_path, env=job_env, capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 0, done.stderr
    assert "gpuherd: job 4242 on 2 node(s): node[01-02]" in done.stdout
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args == [str(repo), "--ntasks-per-node=1", "--kill-on-bad-exit=0", "bash", "run_training.sh",
                    "--slurm", *TRAIN_ARGS]
    assert (tmp_path / "srun.env").read_text().splitlines() == ["NCCL_DEBUG=INFO", "SRUN_CPUS_PER_TASK=64"]
    assert not list(repo.iterdir()) and not (tmp_path / "pwned").exists()


def test_script_outside_slurm_says_how_to_submit(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(options()))
    done = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=10)
    assert done.returncode == 2 and f"submit this script with: sbatch {script}" in done.stderr


# ---- python -m supervisor.commands.sbatch

def run_cli(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.commands.sbatch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=30)


def test_cli_writes_the_script_and_creates_the_log_dir(tmp_path, python_env):
    done = run_cli(["--nodes", "2", "--gpus-per-node", "4", "--output", "job.sbatch", "--log-dir", "slurm-logs",
                    "--", *TRAIN_ARGS], python_env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and "submit it with: sbatch job.sbatch" in done.stderr
    script = (tmp_path / "job.sbatch").read_text()
    found = directives(script)
    assert (found["gres"], found["cpus-per-task"], found["output"]) == \
        ("gpu:4", "32", f"{tmp_path}/slurm-logs/%x-%j.out")  # 8 CPUs per GPU by default
    assert (tmp_path / "slurm-logs").is_dir()
    assert f"cd {shlex.quote(str(slurm.REPO_ROOT))}" in script.splitlines()
    assert shlex.split(script.splitlines()[-1])[6:8] == ["--run-id", f"gpuherd-{script.split('--run-id gpuherd-')[1].split()[0]}"]
    assert shlex.split(script.splitlines()[-1])[8:] == list(TRAIN_ARGS)
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o777 == 0o666 & ~umask  # like any other tool's file
    assert directives(script)["signal"] == "USR1@180"


@pytest.mark.parametrize("args", [
    ["--gpus-per-node", "8"],
    ["--nodes", "0", "--gpus-per-node", "8"],
])
def test_cli_bad_input_exits_2_in_one_line(tmp_path, python_env, args):
    done = run_cli([*args, "--output", "job.sbatch", "--log-dir", "logs"], python_env, tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("gpuherd: error: ") and done.stderr.count("\n") == 1
    assert done.stdout == "" and not list(tmp_path.iterdir())


@pytest.mark.parametrize(("args", "train", "message"), [
    # before: each script was written, and every node refused it at its start (after the queue wait)
    (["--spare-nodes", "1"], [], "system.spare_nodes=1 needs system.max_restarts > 0 (--max-restarts N)"),
    (["--spare-nodes", "1"], ["--max-restarts", "2", "train.py"], "--spare-nodes 1 with a script: a spare node's"),
    (["--nodes", "1", "--spare-nodes", "1"], ["--max-restarts", "2"], "--spare-nodes 1 needs a multi-node job"),
    (["--spare-nodes", "1"], ["--max-restarts", "2", "--spares", "0"], "and live recovery on (system.spares != 0)"),
    # before: written with 99999999999999999999999 spare nodes; `gpuherd run` named 99999999999999991611392
    (["--spare-nodes", "99999999999999999999999"], ["--max-restarts", "2"],
     "system.spare_nodes must fit in a signed 64-bit integer (at most 9223372036854775807), "
     "got 99999999999999999999999 "),
    ([], ["--max-restarts", "two"], "argument --max-restarts/--max_restarts: invalid int value: 'two'"),
    # before: "(0 for CPU-only nodes)", the message of --gpus-per-node
    (["--spare-nodes", "-1"], [], "argument --spare-nodes: expected a whole number (0 for none), got '-1'"),
])
def test_a_job_every_node_would_refuse_is_not_written(tmp_path, python_env, args, train, message):
    """`gpuherd run`'s own parse judges the nodes' command line when the script is written."""
    base = {"--nodes": "2", "--gpus-per-node": "8", "--output": "job.sbatch", "--log-dir": "logs"}
    base.update(zip(args[::2], args[1::2], strict=True))
    done = run_cli([*(part for pair in base.items() for part in pair), "--", *train], python_env, tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith("gpuherd: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert message in done.stderr, done.stderr
    assert not list(tmp_path.iterdir())


def test_a_job_whose_files_are_not_on_this_machine_is_written(tmp_path, python_env):
    """The nodes may see other files than the machine that writes the script (node-local data, a
    script only there): what the nodes' files decide is left to the nodes."""
    done = run_cli(["--nodes", "2", "--gpus-per-node", "8", "--spare-nodes", "1", "--output", "job.sbatch",
                    "--log-dir", "logs", "--", "--max-restarts", "2", "--set", "data.dataset=/node-local/*.txt"],
                   python_env, tmp_path)
    assert done.returncode == 0, done.stderr
    done = run_cli(["--nodes", "2", "--gpus-per-node", "8", "--output", "job2.sbatch", "--log-dir", "logs", "--",
                    "/node-local/train.py"], python_env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert shlex.split((tmp_path / "job2.sbatch").read_text().splitlines()[-1])[-1] == "/node-local/train.py"


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "x"], "argument --nodes: expected a whole number of at least 1, got 'x'"),
    (["--gpus-per-node", "-1"], "argument --gpus-per-node: expected a whole number (0 for CPU-only nodes), got '-1'"),
    (["--cpus-per-task", "0"], "argument --cpus-per-task: expected a whole number"),
    (["--time", "tomorrow"], "argument --time: expected a time like 48:00:00"),
    (["--mem", "12Q"], "argument --mem: expected a size like 200G"),
    (["--job-name", "my job"], "argument --job-name: expected one word without spaces, got 'my job'"),
    (["--partition", "gpu\n#SBATCH --x"], "argument --partition: expected one word"),
    (["--preset", "gpt2-small"], "unrecognized arguments: --preset gpt2-small (arguments for run_training.sh "
                                 "go after --"),
    (["--log-dir", "my logs"], "contains whitespace or '%' (a filename pattern character"),
    (["--stop-warning", "soon"], "argument --stop-warning: expected whole seconds from 0 to 65535, got 'soon'"),
])
def test_bad_flags_exit_2_naming_the_flag(tmp_path, monkeypatch, capsys, args, message):
    monkeypatch.chdir(tmp_path)
    base = {"--nodes": "2", "--gpus-per-node": "8", "--output": "job.sbatch", "--log-dir": "logs"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = [part for pair in base.items() for part in pair]
    with pytest.raises(SystemExit) as exit_info:
        slurm.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("limit", ["90", "30:00", "48:00:00", "2-00", "2-12:30", "7-00:00:00", "UNLIMITED"])
def test_every_sbatch_time_format_is_accepted(limit):
    opts, _ = slurm.parse(["--nodes", "1", "--gpus-per-node", "1", "--time", limit])
    assert opts.time == limit


def test_stdout_is_the_default(capsys, tmp_path):
    assert slurm.main(["--nodes", "1", "--gpus-per-node", "2", "--log-dir", str(tmp_path / "l")]) == 0
    out = capsys.readouterr().out
    run_id = re.search(r"--run-id (\S+)", out).group(1)
    options = slurm.parse(["--nodes", "1", "--gpus-per-node", "2", "--log-dir", str(tmp_path / "l")])[0]
    assert out == render_sbatch(dataclasses.replace(options, run_id=run_id))
    assert out.splitlines()[-1] == f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash run_training.sh --slurm --run-id {run_id}"


def test_each_script_names_its_own_run_and_the_users_run_id_wins():
    """Every submission of one script continues its run (supervisor/requeue.py); a new script is a new run."""
    first, second = (slurm.parse(["--nodes", "2", "--cpu", "--job-name", "my.job/1"])[0] for _ in range(2))
    assert re.fullmatch(r"my.job-1-\d{8}-\d{6}-[0-9a-f]{4}", first.run_id) and first.run_id != second.run_id
    assert f"--slurm --run-id {first.run_id} " in render_sbatch(first)
    for given in (["--run-id", "mine"], ["--run-id=mine"]):
        options = slurm.parse(["--nodes", "2", "--cpu", "--", *given])[0]
        assert options.run_id is None and render_sbatch(options).splitlines()[-1].count("--run-id") == 1


# ---- KillWait: the stop timeout under SLURM

SHOW_CONFIG = """Configuration data as of 2026-01-01T00:00:00
AccountingStorageType   = accounting_storage/none
KillOnBadExit           = 0
KillWait                = 10 sec
MaxJobCount             = 10000
"""


def test_kill_wait_is_read_from_scontrol_show_config(tmp_path, monkeypatch):
    assert slurm_env.parse_kill_wait(SHOW_CONFIG) == 10.0
    assert slurm_env.parse_kill_wait("KillWait = 30\n") == 30.0
    assert slurm_env.parse_kill_wait("nothing here\n") is None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\n[ "$1 $2" = "show config" ] && cat <<"END"\n{SHOW_CONFIG}END\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    assert slurm_env.kill_wait() == 10.0
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    assert slurm_env.kill_wait() is None


def test_the_stop_timeout_ends_before_slurms_kill_wait(tmp_path, python_env):
    """Inside an allocation the supervisor reads KillWait and shortens the stop timeout, so the
    final saves end (or are killed and reported) before SLURM's SIGKILL of the whole job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\n[ "$1 $2" = "show config" ] && cat <<"END"\n{SHOW_CONFIG}END\n')
    (bin_dir / "scontrol").chmod(0o755)
    env = {**sh.env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}
    cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--nproc", "1",
           "--script", str(sh.SCENARIO), "save-on:TERM:60"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert sh.wait_for(lambda: sh.workers_started(proc, 1, tmp_path, lines=3))
    proc.send_signal(signal.SIGTERM)
    code, _, err = sh.finish(proc, timeout=60)
    assert "stop timeout 8 s instead of 120 s: SLURM kills a job 10 s after its SIGTERM (KillWait)" in err
    assert "SIGKILL after 8 s (the stop timeout)" in err
    assert code == 1, err[-3000:]  # the 60 s save was cut: said, not a normal 143
    assert "was killed while saving it" in err


# ---- why SLURM stopped the job: the same words on every node

@pytest.mark.parametrize(("job", "restart_count", "said"), [
    ({"JobState": "COMPLETING", "Reason": "None", "PreemptTime": "None", "Restarts": "0"}, 0, "scancel (SIGTERM)"),
    ({"JobState": "CANCELLED", "Reason": "None"}, 0, "scancel (SIGTERM)"),
    ({"JobState": "COMPLETING", "Reason": "TimeLimit", "Restarts": "0"}, 0, "the time limit (SIGTERM)"),
    ({"JobState": "TIMEOUT"}, 0, "the time limit (SIGTERM)"),
    ({"JobState": "COMPLETING", "PreemptTime": "2026-11-25T16:00:00"}, 0, "preemption (SIGTERM)"),
    ({"JobState": "COMPLETING", "Reason": "None", "Restarts": "2"}, 1, "requeue (SIGTERM)"),  # counted already
    ({"JobState": "PENDING", "Reason": "BeginTime"}, 0, "requeue (SIGTERM)"),
    ({"JobState": "NODE_FAIL", "Reason": "NodeDown"}, 0, "a node failure (SIGTERM)"),
])
def test_stop_reason_reads_the_jobs_state(job, restart_count, said):
    assert slurm_env.stop_reason("SIGTERM", job, restart_count) == f"stopped by SLURM: {said}"


def test_stop_reason_says_nothing_for_a_running_job_or_without_slurm():
    """A SIGTERM while the job still runs is someone's kill, not SLURM's stop."""
    assert slurm_env.stop_reason("SIGTERM", {"JobState": "RUNNING", "Restarts": "0"}) is None
    assert slurm_env.stop_reason("SIGTERM", {}) is None
    assert slurm_env.stop_reason("SIGUSR1", {}).startswith("stopped by SLURM: the time limit is near (SIGUSR1")


def test_job_info_parses_scontrol(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 'JobId=7 JobName=x JobState=COMPLETING Reason=None "
                                      "Restarts=1 PreemptTime=None'\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    info = slurm_env.job_info("7")
    assert (info["JobState"], info["Restarts"], info["PreemptTime"]) == ("COMPLETING", "1", "None")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert slurm_env.job_info("7") == {}


# ---- a preempted job that saved in time: node 0 asks SLURM for the requeue SLURM would not do

PREEMPTED = {"JobState": "RUNNING", "PreemptTime": "2026-11-27T00:19:43", "Requeue": "1", "Partition": "debug"}


def fake_scontrol(tmp_path, monkeypatch, partition_mode: str, requeue_exit: int = 0) -> Path:
    """An scontrol that answers `show partition` and records `requeue` calls in `calls`."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'if [ "$1" = show ]; then echo "PartitionName=debug PriorityTier=1 PreemptMode={partition_mode}"; exit 0; fi\n'
        f'[ "$1" = requeue ] && {{ [ {requeue_exit} = 0 ] || echo "scontrol: error: Job is no longer pending" >&2; '
        f'exit {requeue_exit}; }}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_a_requeueable_preempted_job_is_requeued(tmp_path, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch, "REQUEUE")
    said = slurm_env.requeue_after_preemption("42", PREEMPTED)
    assert said == "SLURM preempted job 42: requeued it (scontrol requeue); its next start continues this run"
    assert calls.read_text().splitlines() == ["show partition -o debug", "requeue 42"]


@pytest.mark.parametrize("job", [
    {**PREEMPTED, "Requeue": "0"},  # submitted with --no-requeue
    {**PREEMPTED, "PreemptTime": "None"},  # a scancel, not a preemption
])
def test_no_requeue_unless_preempted_and_requeueable(tmp_path, monkeypatch, job):
    calls = fake_scontrol(tmp_path, monkeypatch, "REQUEUE")
    assert slurm_env.requeue_after_preemption("42", job) is None
    assert not calls.exists()


def test_a_partition_that_cancels_preempted_jobs_is_obeyed(tmp_path, monkeypatch):
    calls = fake_scontrol(tmp_path, monkeypatch, "CANCEL")
    assert slurm_env.requeue_after_preemption("42", PREEMPTED) is None
    assert "requeue 42" not in calls.read_text()


def test_a_refused_requeue_is_said_in_one_line(tmp_path, monkeypatch):
    fake_scontrol(tmp_path, monkeypatch, "REQUEUE", requeue_exit=1)
    said = slurm_env.requeue_after_preemption("42", PREEMPTED)
    assert said == ("SLURM preempted job 42; asking it to requeue the job failed "
                    "(scontrol requeue: scontrol: error: Job is no longer pending)")
