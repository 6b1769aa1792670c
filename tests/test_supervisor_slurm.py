"""SLURM: reading an allocation from the environment (supervisor/slurm_env.py) and
writing the sbatch script (python -m supervisor.slurm). No SLURM needed: the
environment is a dict and scontrol is a small shell script put first on PATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor import slurm_env
from supervisor.slurm_env import SlurmError, SlurmNode, derived_port, hostnames, read_slurm

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
