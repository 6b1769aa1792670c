"""The faults real NVML has, served by the fake: a GPU answering Unknown Error or No
Permission when opened, MIG mode, host pids seen from a container (a fake /proc),
and garbage pids from a process struct of another driver branch."""

from __future__ import annotations

import os
from pathlib import Path

import pynvml
import pytest

from supervisor.gpus import DeviceError, GpuMonitor, format_device_table, plan_gpus, read_inventory, read_topology
from supervisor.gpus import pids, release_claims, select_least_used
from tests.fake_nvml import GIB, FakeProcess, installed, machine
from tests.supervisor.gpus.helpers import Recorder, captured_log, wait_for


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))
    yield
    release_claims()


def fake_proc(root: Path, namespace: str, status: dict[int, list[int]]) -> pids.PidView:
    """A /proc whose own pid namespace is `namespace` and where pid p's NSpid line is status[p]."""
    (root / "self" / "ns").mkdir(parents=True)
    os.symlink(namespace, root / "self" / "ns" / "pid")  # readlink gives the text back, as the kernel's does
    for pid, nspids in status.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "status").write_text(f"Name:\tpython\nNSpid:\t{chr(9).join(map(str, nspids))}\n")
    return pids.PidView(root)


CONTAINER = "pid:[4026532710]"


def test_unknown_error_at_handle_time_is_a_lost_gpu_not_a_crash():
    m = machine(3)
    m.gpus[1].handle_error = pynvml.NVML_ERROR_UNKNOWN  # what a GPU off the bus often answers
    with installed(m), captured_log() as log:
        gpus = read_inventory()
        assert gpus[1].lost and "Unknown" in gpus[1].lost and not gpus[0].lost and not gpus[2].lost
        assert sum(line.startswith("GPU 1 cannot be used: lost (NVML:") for line in log) == 1
        assert "LOST" in format_device_table(gpus).splitlines()[2]
        with pytest.raises(DeviceError, match="GPU 1 cannot be used: it is lost") as err:
            plan_gpus([1], None, force=False)
        assert err.value.exit_code == 4
        assert [g.index for g in plan_gpus([2, 0], None, force=False)] == [2, 0]
        assert select_least_used(0.1, take_claim=False).gpu.index in (0, 2)
        topo = read_topology([0, 1, 2])
    assert topo.link[0, 1] == topo.link[1, 2] == "n/a" and topo.link[0, 2] == "PXB"
    assert topo.warnings()[0].startswith("GPU 1: links unknown, NVML could not open it (lost (NVML:")


def test_no_permission_leaves_the_gpu_out_or_is_exit_2_when_asked_for():
    m = machine(3)
    m.gpus[2].handle_error = pynvml.NVML_ERROR_NO_PERMISSION  # a cgroup-restricted device
    with installed(m):
        assert [g.index for g in plan_gpus(None, None, force=False)] == [0, 1]
        release_claims()
        with pytest.raises(DeviceError, match="GPU 2 cannot be used: no permission to open it .* a container or "
                                              "cgroup restricts this device") as err:
            plan_gpus([2], None, force=False)
        assert err.value.exit_code == 2
        for gpu in m.gpus[:2]:
            gpu.handle_error = pynvml.NVML_ERROR_NO_PERMISSION
        with pytest.raises(DeviceError, match="no usable GPU: GPU 0 cannot be used: no permission") as err:
            select_least_used(0.1)
        assert err.value.exit_code == 2


def test_mig_enabled_gpu_is_exit_2_with_advice():
    m = machine(2)
    m.gpus[0].mig_mode = (1, 1)
    with installed(m):
        with pytest.raises(DeviceError, match=r"GPU 0 cannot be used: MIG mode is enabled; disable it "
                                              r"\(sudo nvidia-smi -i 0 -mig 0, then reset the GPU\)") as err:
            plan_gpus([0], None, force=False)
        assert err.value.exit_code == 2 and "\n" not in str(err.value)
        assert [g.index for g in plan_gpus(None, None, force=False)] == [1]  # the whole machine: the other one
        release_claims()
        assert select_least_used(0.1, take_claim=False).gpu.index == 1
        m.gpus[1].mig_mode = (1, 1)
        with pytest.raises(DeviceError, match="no usable GPU: GPU 0 cannot be used: MIG mode") as err:
            plan_gpus(None, None, force=False)
        assert err.value.exit_code == 2


def test_garbage_pids_of_a_mismatched_process_struct_are_ignored_with_a_note():
    m = machine(1)
    m.gpus[0].processes = [FakeProcess(4242, 3 * GIB), FakeProcess(4343, GIB), FakeProcess(4444, GIB)]
    m.gpus[0].wide_process_struct = True
    with installed(m), captured_log() as log:
        read = [p.pid for p in read_inventory()[0].processes]
        read_inventory()
    # entries 2 and 3 come out as pid 0 and 4294967295, read at the wrong offset
    assert read == [4242]
    notes = [line for line in log if "impossible process ids" in line]
    assert len(notes) == 1 and "[0, 4294967295]" in notes[0]


def monitor_once(m, workers: dict[int, int]) -> Recorder:
    with installed(m):
        gpus = read_inventory()
        rec = Recorder()
        mon = GpuMonitor(gpus, {0: 0}, lambda: workers, rec.sink, rec.warn, rec.fatal, interval=60)
        mon.start()
        assert wait_for(lambda: rec.of_type("gpu"))
        mon.stop()
    return rec


def test_in_a_container_our_worker_is_found_by_its_host_pid(tmp_path, monkeypatch):
    m = machine(1)
    m.gpus[0].processes = [FakeProcess(400123, 20 * GIB)]  # NVML speaks host pids
    monkeypatch.setattr(pids, "VIEW", fake_proc(tmp_path / "proc", CONTAINER, {57: [400123, 57]}))
    rec = monitor_once(m, {0: 57})
    record = rec.of_type("gpu")[0]
    assert record["worker_mem"] == {"0": 20 * GIB} and record["foreign"] == [] and record["unknown_owner"] == []
    assert rec.warnings == []


def test_in_a_container_unmatched_pids_are_unknown_owners_not_other_processes(tmp_path, monkeypatch):
    m = machine(1)
    m.gpus[0].processes = [FakeProcess(400123, 20 * GIB)]
    # this /proc shows only the container's numbers: our worker's host pid cannot be matched
    monkeypatch.setattr(pids, "VIEW", fake_proc(tmp_path / "proc", CONTAINER, {57: [57]}))
    rec = monitor_once(m, {0: 57})
    assert rec.of_type("gpu")[0]["unknown_owner"] == [{"pid": 400123, "mem": 20 * GIB}]
    assert rec.warnings == []  # one process for our one worker: probably ours, never "another process"
    m.gpus[0].processes.append(FakeProcess(400999, GIB))
    rec = monitor_once(m, {0: 57})
    assert rec.warnings == ["GPU 0 (rank 0): 2 process(es) on this GPU (host pids 400123, 400999) for 1 worker(s) "
                            "of this run: another container or job shares this GPU"]
    with installed(m):
        busy = read_inventory()[0].foreign_processes()
    assert busy[0].describe() == "pid 400123 (a host pid, owner unknown from inside this container) 20.0 GiB"


def test_on_the_host_an_unmatched_pid_is_another_process(tmp_path, monkeypatch):
    m = machine(1)
    m.gpus[0].processes = [FakeProcess(400123, 20 * GIB)]
    monkeypatch.setattr(pids, "VIEW", fake_proc(tmp_path / "proc", pids.HOST_PID_NAMESPACE, {57: [57]}))
    rec = monitor_once(m, {0: 57})
    assert rec.of_type("gpu")[0]["foreign"] == [{"pid": 400123, "mem": 20 * GIB}]
    assert len(rec.warnings) == 1 and rec.warnings[0].startswith("GPU 0 (rank 0): another process shares this GPU")


def test_monitor_survives_a_gpu_it_may_no_longer_open():
    m = machine(2)
    with installed(m):
        gpus = read_inventory()
        m.gpus[1].handle_error = pynvml.NVML_ERROR_NO_PERMISSION
        rec = Recorder()
        mon = GpuMonitor(gpus, {0: 0, 1: 1}, dict, rec.sink, rec.warn, rec.fatal, interval=60)
        mon.start()
        assert wait_for(lambda: rec.of_type("gpu"))
        mon.stop()
    assert rec.warnings[0].startswith("GPU 1 (rank 1): not monitored, NVML cannot open it")
    assert [r["gpu"] for r in rec.of_type("gpu")] == [0] and rec.fatals == []
