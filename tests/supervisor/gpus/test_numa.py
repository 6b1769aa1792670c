"""--numa-binding's CPU sets (supervisor/gpus/numa.py), on made-up hosts: two sockets, two NUMA
nodes each, hyperthreads, last-level-cache groups; and read back from a fake /sys."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.gpus import DeviceError
from supervisor.gpus.numa import Host, bind_gpus, gpu_node, parse_ranges, ranges, read_host


def two_socket_host() -> Host:
    """Sockets 0 and 1, NUMA nodes 0,1 on socket 0 and 2,3 on socket 1; 4 cores per node, 2 threads
    per core (CPU c and c+32 are siblings); cores 0-1 and 2-3 of each node share a cache."""
    node_cpus, socket, core, cache = {}, {}, {}, {}
    for node in range(4):
        cores = range(node * 4, node * 4 + 4)
        node_cpus[node] = frozenset([*cores, *(c + 32 for c in cores)])
        for c in cores:
            for cpu in (c, c + 32):
                socket[cpu] = node // 2
                core[cpu] = (node // 2, c)
                pair = (c // 2) * 2
                cache[cpu] = frozenset({pair, pair + 1, pair + 32, pair + 33})
    return Host(node_cpus, socket, core, cache)


def test_node_binds_every_cpu_of_the_gpus_node():
    first, second = bind_gpus("node", [0, 3], two_socket_host())
    assert first.cpus == frozenset({0, 1, 2, 3, 32, 33, 34, 35}) and first.nodes == {0}
    assert second.cpus == frozenset({12, 13, 14, 15, 44, 45, 46, 47}) and second.nodes == {3}


def test_socket_binds_every_node_of_the_gpus_socket():
    (binding,) = bind_gpus("socket", [2], two_socket_host())
    assert binding.nodes == {2, 3} and binding.cpus == frozenset([*range(8, 16), *range(40, 48)])


def test_exclusive_splits_a_shared_node_into_disjoint_whole_cores():
    bindings = bind_gpus("exclusive", [0, 0, 0, 1], two_socket_host())
    assert [b.cpus for b in bindings[:3]] == [frozenset({0, 1, 32, 33}), frozenset({2, 34}), frozenset({3, 35})]
    assert bindings[3].cpus == two_socket_host().node_cpus[1]  # alone on node 1: all of it
    with pytest.raises(DeviceError, match="4 physical core"):
        bind_gpus("exclusive", [0] * 5, two_socket_host())


def test_core_complex_gives_each_worker_one_cache_group_of_its_node():
    bindings = bind_gpus("core-complex", [1, 1], two_socket_host())
    assert [b.cpus for b in bindings] == [frozenset({4, 5, 36, 37}), frozenset({6, 7, 38, 39})]
    with pytest.raises(DeviceError, match="2 cache group"):
        bind_gpus("core-complex", [1, 1, 1], two_socket_host())


def test_only_cpus_this_process_may_use_and_numactls_arguments(tmp_path):
    sys_root = fake_sys(tmp_path)
    host = read_host(sys_root, allowed={0, 1, 2, 3, 5})  # CPU 4 is outside this process's affinity
    assert host.node_cpus == {0: {0, 1, 2}, 1: {3, 5}}
    assert host.cpu_core[1] == (0, 1) and host.cpu_cache[3] == {3, 5}
    assert gpu_node("00000000:3B:00.0", None, host, sys_root) == 1  # the kernel's numa_node
    assert gpu_node("00000000:AF:00.0", {3, 4, 5}, host, sys_root) == 1  # -1 there: NVML's near CPUs
    assert gpu_node("00000000:AF:00.0", None, host, sys_root) == 0
    (binding,) = bind_gpus("node", [1], host)
    assert binding.numactl() == ["numactl", "--physcpubind=3,5", "--membind=1"]
    assert ranges({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and parse_ranges("0-2,5,7-8\n") == {0, 1, 2, 5, 7, 8}


def fake_sys(root: Path) -> Path:
    """Two nodes (CPUs 0-2, 3-5), one socket, one core per CPU, L3 shared per node."""
    for node, cpus in ((0, "0-2"), (1, "3-5")):
        (root / f"devices/system/node/node{node}").mkdir(parents=True)
        (root / f"devices/system/node/node{node}/cpulist").write_text(cpus + "\n")
    for cpu in range(6):
        base = root / f"devices/system/cpu/cpu{cpu}"
        (base / "topology").mkdir(parents=True)
        (base / "topology/physical_package_id").write_text("0\n")
        (base / "topology/core_id").write_text(f"{cpu}\n")
        for index, (level, shared) in enumerate(((1, str(cpu)), (3, "0-2" if cpu < 3 else "3-5"))):
            (base / f"cache/index{index}").mkdir(parents=True)
            (base / f"cache/index{index}/level").write_text(f"{level}\n")
            (base / f"cache/index{index}/shared_cpu_list").write_text(shared + "\n")
    for bus, node in (("0000:3b:00.0", "1"), ("0000:af:00.0", "-1")):
        (root / f"bus/pci/devices/{bus}").mkdir(parents=True)
        (root / f"bus/pci/devices/{bus}/numa_node").write_text(node + "\n")
    return root


def test_a_worker_starts_under_numactl_where_it_is_installed(monkeypatch):
    from supervisor.gpus import numa as numa_module
    from supervisor.torchrun import bound, numa_plan

    (binding,) = bind_gpus("node", [1], two_socket_host())
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    assert bound(binding, ["python", "-u", "t.py"]) == [
        "numactl", "--physcpubind=4-7,36-39", "--membind=1", "python", "-u", "t.py"]
    monkeypatch.setattr("shutil.which", lambda name: None)  # then its CPU affinity is set after the spawn
    assert bound(binding, ["python"]) == ["python"] and bound(None, ["python"]) == ["python"]
    assert numa_module.MODES == ("node", "socket", "exclusive", "core-complex")
    from supervisor.gpus import DevicePlan, DeviceSlot

    cpu_plan = DevicePlan(slots=(DeviceSlot(0, "cpu", 0),), isolate=False)
    assert numa_plan("node", cpu_plan) == [] and numa_plan(None, cpu_plan) == []
