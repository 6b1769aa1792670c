"""Least-used selection (with claims) and the topology matrix against the fake NVML."""

from __future__ import annotations

import random

import pytest

from supervisor.gpus import DeviceError, read_topology, select_least_used
from supervisor.gpus.claim import claim_holder, try_claim
from supervisor.health.nccl_transport import NcclTransportWatch
from tests.fake_nvml import GIB, NODE, PIX, FakeProcess, installed, machine, no_nvml


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))


def test_picks_lowest_average_utilization_and_claims_it():
    m = machine(4)
    for gpu, util in zip(m.gpus, (90, 40, 5, 60), strict=True):
        gpu.utilization = util
    with installed(m):
        sel = select_least_used(0.2)
    assert sel.gpu.index == 2 and claim_holder(sel.gpu.uuid) is not None
    assert [c.gpu.index for c in sel.candidates] == [2, 1, 3, 0]
    assert "chosen" in sel.table().splitlines()[1] and "5%" in sel.table()
    sel.claim.release()
    assert claim_holder(sel.gpu.uuid) is None


def test_utilization_is_averaged_over_the_window_not_one_snapshot(monkeypatch):
    m = machine(2)
    reads = {0: iter([100, 0, 0, 0]), 1: iter([0, 50, 50, 50])}  # GPU 0 idle but for a spike
    from supervisor.gpus import selection
    real = selection.nvml.FieldReader.read

    def scripted(self, index, field, *calls):
        if field == "utilization":
            return next(reads[index])
        return real(self, index, field, *calls)

    monkeypatch.setattr(selection.nvml.FieldReader, "read", scripted)
    monkeypatch.setattr(selection, "SAMPLE_EVERY", 0.01)
    with installed(m):
        sel = select_least_used(0.04, take_claim=False)
    assert sel.gpu.index == 0 and [c.util_avg for c in sel.candidates] == [25.0, 37.5]


def test_busy_throttling_and_memory_order_and_random_ties():
    m = machine(4)
    m.gpus[0].processes.append(FakeProcess(1, GIB))  # busy
    m.gpus[1].clocks_event_reasons = 0x20  # thermal throttling
    m.gpus[3].memory_used = 40 * GIB  # less free memory than GPU 2
    with installed(m):
        sel = select_least_used(0.1, take_claim=False)
        assert [c.gpu.index for c in sel.candidates] == [2, 3, 1, 0]
        m.gpus[3].memory_used = m.gpus[2].memory_used
        picks = {select_least_used(0.1, take_claim=False, rng=random.Random(seed)).gpu.index for seed in range(12)}
    assert picks == {2, 3}


def test_claimed_gpus_are_skipped_and_all_busy_is_exit_4():
    m = machine(2)
    with installed(m):
        held = try_claim(m.gpus[0].uuid)
        sel = select_least_used(0.1)
        assert sel.gpu.index == 1  # GPU 0 looked as good, but another run holds it
        sel.claim.release()
        m.gpus[1].processes.append(FakeProcess(1, GIB))
        with pytest.raises(DeviceError, match="no free GPU: GPU 0 claimed by another gpuherd run, GPU 1 busy") as err:
            select_least_used(0.1)
        assert err.value.exit_code == 2
        assert select_least_used(0.1, force=True).gpu.index == 1
        held.release()


def test_no_gpu_is_exit_2():
    with no_nvml(), pytest.raises(DeviceError, match="no GPU found") as err:
        select_least_used(0.1)
    assert err.value.exit_code == 2
    with installed(machine(2)), pytest.raises(DeviceError, match=r"no GPU to select from \(CUDA_VISIBLE_DEVICES=\)"):
        select_least_used(0.1, allowed_env="")


@pytest.mark.parametrize(("profile", "expect", "warns"), [
    (lambda: machine(1), [], 0),
    (lambda: machine(4, nvlink=True), ["NV4"] * 6, 0),
    (lambda: machine(8, nvswitch=True), ["NV18"] * 28, 0),
    (lambda: machine(4, level=PIX), ["PIX"] * 6, 0),
    (lambda: machine(4, level=NODE), ["NODE"] * 6, 2),
    (lambda: machine(4, sockets=2), ["PXB", "SYS", "SYS", "SYS", "SYS", "PXB"], 2),
])
def test_topology_profiles(profile, expect, warns):
    m = profile()
    with installed(m):
        topo = read_topology(list(range(len(m.gpus))))
    assert [topo.link[p] for p in topo.pairs()] == expect
    assert len(topo.warnings()) == warns
    assert all(topo.p2p[p] == ("OK" if kind not in ("NODE", "SYS") else "CNS") for p, kind in zip(topo.pairs(), expect, strict=True))
    if warns:
        assert "single GPU" in topo.warnings()[0] and "NCCL_P2P_LEVEL=SYS" in topo.warnings()[0]
        assert "no GPU peer-to-peer access" in topo.warnings()[1]


def test_topology_format_reads_like_nvidia_smi_topo():
    with installed(machine(4, sockets=2)):
        lines = read_topology([0, 1, 2, 3]).format().splitlines()
    assert lines[0].split() == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert lines[1].split() == ["GPU0", "X", "PXB", "SYS", "SYS"]
    assert lines[3].split() == ["GPU2", "SYS", "SYS", "X", "PXB"]
    assert "P2P read:" in lines and any(line.startswith("  SYS  = ") for line in lines)


def test_topology_on_old_driver_without_nvlink_calls_uses_pci_levels():
    m = machine(2, nvlink=True)
    m.missing = ["nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemotePciInfo_v2"]
    with installed(m):
        topo = read_topology([0, 1])
    assert topo.link[0, 1] == "PXB" and topo.p2p[0, 1] == "OK"


def test_nccl_transport_watch_warns_once_per_slow_pair():
    watch = NcclTransportWatch({0, 1, 2})
    assert watch.feed("node:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC") is None
    warning = watch.feed("node:1:1 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[2] via SHM/direct/direct")
    assert warning.startswith("NCCL connects rank 1 -> rank 2 via SHM")
    assert watch.feed("NCCL INFO Channel 01/0 : 2[2] -> 1[1] via SHM/direct/direct") is None
    assert watch.feed("NCCL INFO Channel 00/0 : 2[2] -> 0[0] [send] via NET/Socket/0").startswith("NCCL connects rank 2")
    assert watch.transports[0, 1] == "P2P"


def test_worker_nccl_lines_reach_the_transport_watch(tmp_path):
    """NCCL_DEBUG=INFO output on a worker's stdout: the supervisor warns about the slow pair once."""
    from loguru import logger

    from supervisor.output.console import STDOUT, Console
    from supervisor.output.router import LogRouter, WorkerLog

    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    console = Console()  # writes to fd 1: pytest captures it
    try:
        logs = [WorkerLog(rank, f"GPU{rank}", tmp_path / f"w{rank}.log") for rank in (0, 1)]
        router = LogRouter(logs, console, nccl_watch=NcclTransportWatch({0, 1}))
        chunk = (b"h:1:1 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via SHM/direct/direct\n"
                 b"h:1:1 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] via SHM/direct/direct\nplain line\n")
        router.feed(1, STDOUT, chunk, 0.0)
        router.close()
    finally:
        logger.remove(sink)
    assert [m for m in warnings if "via SHM" in m] == [warnings[0]] and len(warnings) == 1
    assert "rank 1 -> rank 0 via SHM" in warnings[0]
