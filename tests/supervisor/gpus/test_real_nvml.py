"""`pytest -m gpu`: the NVML layer against the real driver (the fake NVML's twin).

A worker-like child allocates CUDA memory; NVML must list it (by its host pid when
we run in a container) with plausible memory, and a child isolated with
CUDA_VISIBLE_DEVICES must get the GPU whose UUID NVML gives for that id. Skipped
without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gpuherd.contract import cuda_defaults, same_device_uuid
from supervisor.gpus import GpuMonitor, pids, read_inventory, read_topology, select_least_used
from supervisor.gpus import nvml
from supervisor.gpus.topology import LEVEL_NAMES
from tests.supervisor.gpus.helpers import Recorder, wait_for

pytestmark = pytest.mark.gpu

HOLDER = """
import sys, torch
block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def gpu_holder():
    """A child process holding 256 MiB on GPU 0 until the test ends."""
    env = {**cuda_defaults({}), **os.environ, "CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    yield proc.pid
    proc.stdin.close()
    proc.wait(timeout=30)


def test_inventory_reads_every_gpu():
    gpus = read_inventory()
    assert gpus, "NVML sees no GPU on a machine where CUDA does"
    for gpu in gpus:
        assert gpu.lost is None, gpu.lost
        assert gpu.uuid.startswith("GPU-") and gpu.name and gpu.memory_total > 2**30
        assert gpu.processes is None or all(0 < p.pid < nvml.PID_MAX_LIMIT for p in gpu.processes)


def test_mig_mode_is_readable():
    with nvml.session() as pynvml:
        handles, failed = nvml.handles(pynvml)
        assert not failed, {i: e.reason for i, e in failed.items()}
        assert all(isinstance(nvml.mig_enabled(pynvml, h), bool) for h in handles.values())


def test_our_process_is_listed_with_plausible_memory(gpu_holder: int):
    with nvml.session() as pynvml:
        found = dict(nvml.compute_processes(pynvml, nvml.handle_by_index(pynvml, 0)))
    owners = pids.VIEW.owners(list(found), {gpu_holder: 0})
    ours = [pid for pid, (kind, _) in owners.items() if kind == pids.OURS]
    if pids.VIEW.in_host_namespace() or ours:
        assert len(ours) == 1, (found, owners)
        used = found[ours[0]]
        assert used is None or 256 * 2**20 <= used < 64 * 2**30  # WDDM says None; else our block plus context
    else:  # a container whose /proc cannot show host pids: never "another process"
        assert all(kind == pids.UNKNOWN for kind, _ in owners.values())
        assert any((used or 0) >= 256 * 2**20 for used in found.values())


def test_monitor_attributes_the_worker_memory(gpu_holder: int):
    gpu = read_inventory()[0]
    rec = Recorder()
    mon = GpuMonitor([gpu], {gpu.index: 0}, lambda: {0: gpu_holder}, rec.sink, rec.warn, rec.fatal, interval=60)
    mon.start()
    try:
        assert wait_for(lambda: rec.of_type("gpu"), timeout=10)
    finally:
        mon.stop()
    record = rec.of_type("gpu")[0]
    assert rec.fatals == [] and isinstance(record["mem_total"], int)
    assert record["worker_mem"].get("0") or record["unknown_owner"], record
    assert not any("another process shares this GPU: pid " + str(gpu_holder) in w for w in rec.warnings)


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_an_isolated_worker_gets_the_gpu_nvml_names(index: int):
    gpus = read_inventory()
    if index >= len(gpus):
        pytest.skip(f"this machine has {len(gpus)} GPU(s)")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count(), "
                          "torch.cuda.get_device_properties(0).uuid)"], env=env, capture_output=True, text=True,
                         timeout=120)
    count, uuid = out.stdout.split()
    assert count == "1" and same_device_uuid(uuid, gpus[index].uuid), (uuid, gpus[index].uuid)


def test_topology_and_selection_read_the_real_driver():
    gpus = read_inventory()
    topo = read_topology([g.index for g in gpus])
    names = {*LEVEL_NAMES.values(), nvml.NA}
    assert all(link in names or link.startswith("NV") for link in topo.link.values())
    assert not topo.unopened
    chosen = select_least_used(0.2, take_claim=False).gpu
    assert chosen.index in [g.index for g in gpus] and not chosen.lost and not chosen.unusable
