"""Several ranks on one GPU (system.shared_gpu_for_tests): refused without the setting, and
with it the device plan and the environment each rank and warm spare gets, against the fake
NVML; the worker's backend is gloo there; a real supervisor says so in one WARNING line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch

from gpuherd.config import SystemConfig, preset
from supervisor.gpus import DeviceError, plan_devices, release_claims
from supervisor.processes.worker_env import RunEnv, worker_env
from tests.fake_nvml import installed, machine, no_nvml, subprocess_env
from tests.supervisor.helpers import env
from worker.distributed import backend_for

SHOW_ENV = Path(__file__).resolve().parents[2] / "e2e" / "dropin" / "show_env.py"


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))
    yield tmp_path / "locks"
    release_claims()


def _shared(**kw) -> SystemConfig:
    return SystemConfig(shared_gpu_for_tests=True, **kw)


@pytest.mark.parametrize(("system", "nproc_explicit", "message"), [
    (SystemConfig(nproc=2), True, r"--nproc 2 asks for more workers than the 1 usable GPU\(s\) \(0\)"),
    (SystemConfig(gpus=[0, 0]), False, "--gpus names GPU 0 twice"),
])
def test_two_ranks_on_one_gpu_are_refused_without_the_setting(system, nproc_explicit, message):
    with installed(machine(1)), pytest.raises(DeviceError, match=message) as err:
        plan_devices(system, None, nproc_explicit=nproc_explicit)
    assert err.value.exit_code == 2
    assert not SystemConfig().shared_gpu_for_tests  # never a default


def test_every_rank_is_planned_on_the_one_gpu_and_sees_it_alone():
    with installed(machine(1)) as lib:
        plan = plan_devices(_shared(nproc=3), None, nproc_explicit=True)
    uuid = lib.machine.gpus[0].uuid
    assert plan.shared and plan.world_size == 3 and [g.index for g in plan.gpus] == [0]
    assert [(s.rank, s.kind, s.device_id, s.uuid) for s in plan.slots] == [(r, "cuda", 0, uuid) for r in range(3)]
    assert [plan.visible_devices(s) for s in plan.slots] == ["0", "0", "0"]
    assert plan.warning == ("system.shared_gpu_for_tests: 3 ranks and every warm spare share GPU 0, collectives "
                            "over gloo: for gpuherd's own GPU tests only; step times are no measure of throughput")
    run = RunEnv(run_id="r", run_dir="/tmp/r", master_addr="127.0.0.1", master_port=29500, supervisor_pid=1)
    envs = [worker_env({}, plan, slot, run, status_fd=9) for slot in plan.slots]
    assert [(e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) for e in envs] == [("0", "0", "3"), ("1", "1", "3"),
                                                                             ("2", "2", "3")]
    assert {(e["CUDA_VISIBLE_DEVICES"], e["CUDA_DEVICE_ORDER"], e["GPUHERD_DEVICE_ID"], e["GPUHERD_DEVICE_UUID"],
             e["GPUHERD_DEVICE_KIND"]) for e in envs} == {("0", "PCI_BUS_ID", "0", uuid, "cuda")}


def test_the_gpu_is_the_one_named_or_the_first_allowed_and_a_script_run_sees_it_alone_too():
    with installed(machine(4)):
        named = plan_devices(_shared(gpus=[2], isolate=False), None, nproc_explicit=False)
        release_claims()
        first_allowed = plan_devices(_shared(nproc=2), "3,1", nproc_explicit=False)
        release_claims()
        train_gpu = plan_devices(_shared(device_id=1), None, nproc_explicit=False)
    assert [s.device_id for s in named.slots] == [2, 2] and named.visible_devices(named.slots[1]) == "2"
    assert [s.device_id for s in first_allowed.slots] == [3, 3] and [g.index for g in first_allowed.gpus] == [3]
    assert [s.device_id for s in train_gpu.slots] == [1, 1]


@pytest.mark.parametrize(("system", "message"), [
    (_shared(device="cpu"), "system.shared_gpu_for_tests puts every rank on one GPU, but system.device=cpu"),
    (_shared(backend="nccl"), "system.shared_gpu_for_tests: NCCL refuses one GPU twice in a communicator; the ranks "
                              r"use gloo \(leave system.backend at auto, or set gloo\)"),
    (_shared(gpus=[0, 1]), "system.shared_gpu_for_tests puts every rank on one GPU, but --gpus names 2: 0,1"),
])
def test_what_cannot_share_one_gpu_is_refused_in_one_line(system, message):
    with installed(machine(2)), pytest.raises(DeviceError, match=message) as err:
        plan_devices(system, None, nproc_explicit=False)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


@pytest.mark.parametrize("visible", [None, ""])
def test_no_gpu_to_share_is_refused_not_a_cpu_fallback(visible):
    context = no_nvml() if visible is None else installed(machine(2))
    with context, pytest.raises(DeviceError, match="system.shared_gpu_for_tests needs a CUDA GPU to share, but none "
                                                   "is usable") as err:
        plan_devices(_shared(), visible, nproc_explicit=False)
    assert err.value.exit_code == 2


def test_the_workers_collectives_go_over_gloo_on_a_shared_gpu():
    cfg = preset("debug")
    cuda = torch.device("cuda", 0)
    assert backend_for(cfg, cuda) == "nccl"
    cfg.system.shared_gpu_for_tests = True
    assert backend_for(cfg, cuda) == "gloo"


def test_a_real_run_says_so_once_and_every_rank_sees_the_one_gpu(tmp_path):
    """The supervisor on one fake GPU: 2 ranks of a script, each told the same GPU."""
    cmd = [sys.executable, "-m", "supervisor", "--skip-checks", "--no-report", "--nproc", "2", "--set",
           "system.shared_gpu_for_tests=true", "--script", str(SHOW_ENV)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(machine(1), tmp_path, env()), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = sorted((orjson.loads(line.split("ENV ", 1)[1]) for line in proc.stdout.splitlines() if "ENV {" in line),
                  key=lambda e: e["RANK"])
    assert [(e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in seen] == [("0", "0", "0"), ("1", "1", "0")]
    warnings = [line for line in proc.stderr.splitlines() if "system.shared_gpu_for_tests" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "2 ranks and every warm spare share GPU 0" in warnings[0]


def test_a_real_run_refuses_nccl_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "supervisor", "--skip-checks", "--debug", "--nproc", "2", "--set",
           "system.shared_gpu_for_tests=true", "--set", "system.backend=nccl"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(machine(1), tmp_path, env()), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "NCCL refuses one GPU twice in a communicator" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "logs").exists()
