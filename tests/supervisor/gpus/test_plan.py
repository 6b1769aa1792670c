"""plan_gpus, CUDA_VISIBLE_DEVICES, claims and the device table against the fake NVML."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from supervisor.gpus import DeviceError, format_device_table, plan_gpus, read_inventory, release_claims
from supervisor.gpus.claim import CLAIM_FDS_ENV, claim_holder, inherited_claims, try_claim
from tests.fake_nvml import GIB, OLD_DRIVER_MISSING, FakeProcess, installed, machine, no_nvml


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))
    yield tmp_path / "locks"
    release_claims()


def ids(gpus):
    return [g.index for g in gpus]


def test_all_gpus_in_pci_order_keyed_by_uuid():
    with installed(machine(4)):
        gpus = plan_gpus(None, None, force=False)
    assert ids(gpus) == [0, 1, 2, 3]
    assert len({g.uuid for g in gpus}) == 4 and gpus[2].pci_bus_id == "00000000:38:00.0"


def test_requested_order_is_kept_and_cuda_visible_devices_limits():
    with installed(machine(8, nvlink=True)) as lib:
        assert ids(plan_gpus([3, 1], None, force=False)) == [3, 1]
        release_claims()
        uuid5 = lib.machine.gpus[5].uuid
        assert ids(plan_gpus(None, f"2,{uuid5[:12]}", force=False)) == [2, 5]
        release_claims()
        with pytest.raises(DeviceError, match=r"GPU 0 is not in CUDA_VISIBLE_DEVICES=2,5") as err:
            plan_gpus([0], "2,5", force=False)
        assert err.value.exit_code == 2


@pytest.mark.parametrize(("requested", "env", "message"), [
    ([9], None, "GPU 9 does not exist: this machine has GPUs 0-3"),
    ([1, 1], None, "names GPU 1 twice"),
    ([], None, "--gpus is empty"),
    (None, "0,7", "CUDA_VISIBLE_DEVICES=0,7: GPU 7 does not exist"),
    (None, "GPU-ffff", "UUID GPU-ffff matches no GPU"),
    (None, "GPU-0000000", "UUID GPU-0000000 matches GPUs 0, 1, 2, 3"),
    (None, "MIG-abc", "MIG instance MIG-abc is not supported"),
    (None, "0,zero", "'zero' is neither a GPU id"),
])
def test_usage_errors_exit_2(requested, env, message):
    with installed(machine(4)), pytest.raises(DeviceError, match=message) as err:
        plan_gpus(requested, env, force=False)
    assert err.value.exit_code == 2 and "\n" not in str(err.value)


def test_no_nvml_means_cpu_unless_gpus_were_requested():
    with no_nvml():
        assert plan_gpus(None, None, force=False) == []
        with pytest.raises(DeviceError, match="GPU 0 requested but no GPU is usable") as err:
            plan_gpus([0], None, force=False)
    assert err.value.exit_code == 2


def test_empty_cuda_visible_devices_allows_nothing():
    with installed(machine(2)):
        assert plan_gpus(None, "", force=False) == []


def test_busy_gpu_exit_4_unless_force():
    m = machine(2)
    m.gpus[1].processes.append(FakeProcess(1, 5 * GIB))  # pid 1: never one of ours
    with installed(m):
        with pytest.raises(DeviceError, match=r"GPU 1 is busy: 1 other process\(es\) hold 5.0 GiB") as err:
            plan_gpus([1], None, force=False)
        assert err.value.exit_code == 2  # issue 5: a busy GPU is a usage error (choose another or --force)
        assert ids(plan_gpus([1], None, force=True)) == [1]


def test_lost_gpu_exit_4_but_others_still_plan():
    with installed(machine(3)) as lib:
        lib.lose(1)
        assert read_inventory()[1].lost
        with pytest.raises(DeviceError, match="GPU 1 cannot be used: it is lost") as err:
            plan_gpus([1], None, force=False)
        assert err.value.exit_code == 4
        assert ids(plan_gpus([0, 2], None, force=False)) == [0, 2]


def test_old_driver_falls_back_to_v1_memory_and_v2_processes():
    m = machine(1)
    m.missing = list(OLD_DRIVER_MISSING)
    m.gpus[0].processes.append(FakeProcess(1, GIB))
    with installed(m) as lib:
        (gpu,) = read_inventory()
    assert gpu.processes[0].pid == 1 and gpu.memory_total == 80 * GIB
    assert "nvmlDeviceGetComputeRunningProcesses_v2" in lib.calls and "nvmlDeviceGetMemoryInfo" in lib.calls


def test_plan_claims_gpus_and_a_second_run_is_refused(lock_dir):
    with installed(machine(2)) as lib:
        plan_gpus([0], None, force=False)
        uuid0 = lib.machine.gpus[0].uuid
        # another process sees the claim, with our pid as holder
        probe = subprocess.run(
            [sys.executable, "-c", "import sys; from supervisor.gpus.claim import claim_holder; "
             f"print(claim_holder('{uuid0}'))"], capture_output=True, text=True, env=os.environ, check=True)
        assert probe.stdout.strip() == str(os.getpid())
        release_claims()
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; from supervisor.gpus.claim import try_claim; "
             f"c = try_claim('{uuid0}'); print('held', flush=True); time.sleep(30)"],
            stdout=subprocess.PIPE, text=True, env=os.environ)
        try:
            assert holder.stdout.readline().strip() == "held"
            with pytest.raises(DeviceError, match=f"GPU 0 is claimed by another gpuherd run \\(pid {holder.pid}\\)") as err:
                plan_gpus([0, 1], None, force=False)
            assert err.value.exit_code == 2
            assert claim_holder(lib.machine.gpus[1].uuid) is None  # all or nothing: GPU 1 released again
        finally:
            holder.kill()
            holder.wait()
        assert claim_holder(uuid0) is None  # the kernel dropped the dead holder's claim
        assert ids(plan_gpus([0], None, force=False)) == [0]


def test_inherited_claim_is_adopted_not_seen_as_foreign(monkeypatch):
    with installed(machine(1)) as lib:
        uuid = lib.machine.gpus[0].uuid
        parent = try_claim(uuid)
        monkeypatch.setenv(CLAIM_FDS_ENV, parent.make_inheritable())
        assert ids(plan_gpus([0], None, force=False)) == [0]
        handed_over, parent.fd = parent.fd, -1  # as after exec: plan_gpus now owns the descriptor
        assert CLAIM_FDS_ENV not in os.environ  # workers never see it
        assert not os.get_inheritable(handed_over)
        assert inherited_claims({CLAIM_FDS_ENV: f"{uuid}=999"}) == {}  # a stale number is ignored


def test_device_table_names_ranks_and_foreign_processes():
    m = machine(2)
    m.gpus[1].processes.append(FakeProcess(1, 2 * GIB))
    with installed(m) as lib:
        gpus = read_inventory()
        lib.lose(0)
        lost = read_inventory()[0]
    table = format_device_table([lost, gpus[1]], {1: 0}).splitlines()
    assert table[0].split() == ["rank", "GPU", "name", "memory", "UUID", "PCI", "bus", "other", "processes"]
    assert table[1].split()[:3] == ["-", "0", "LOST"]
    row = table[2]
    assert row.split()[:2] == ["0", "1"] and "0.5/80.0 GiB" in row and "GPU-00000001" in row
    assert "00000000:28:00.0" in row and "pid 1 " in row and "2.0 GiB" in row


def test_device_uuid_comparison_accepts_torch_and_nvml_forms():
    from gpuherd.contract import same_device_uuid
    with installed(machine(2)) as lib:
        gpu = read_inventory()[1]
        other = lib.machine.gpus[0].uuid
    assert same_device_uuid(gpu.uuid, gpu.uuid)
    assert same_device_uuid(gpu.uuid[4:].upper(), gpu.uuid)  # torch: no GPU- prefix
    assert not same_device_uuid(other, gpu.uuid)
    assert not same_device_uuid("", gpu.uuid)  # no GPU at all is never a match
