"""The fake libnvidia-ml answers the real, unchanged pynvml like a driver would."""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from tests.fake_nvml import GIB, OLD_DRIVER_MISSING, SYS, FakeProcess, installed, machine, no_nvml


def test_pynvml_reads_structs_through_the_fake():
    with installed(machine(4, sockets=2)) as lib:
        pynvml.nvmlInit()
        try:
            assert pynvml.nvmlDeviceGetCount() == 4
            h = pynvml.nvmlDeviceGetHandleByIndex(2)
            assert pynvml.nvmlDeviceGetUUID(h).startswith("GPU-00000002")
            assert pynvml.nvmlDeviceGetPciInfo(h).busId == "00000000:38:00.0"
            mem = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            assert (mem.total, mem.used) == (80 * GIB, 512 * 1024**2)
            lib.machine.gpus[2].processes.append(FakeProcess(4242, 3 * GIB))
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 3 * GIB)]
            h0 = pynvml.nvmlDeviceGetHandleByIndex(0)
            assert pynvml.nvmlDeviceGetTopologyCommonAncestor(h0, h) == SYS
            with pytest.raises(pynvml.NVMLError_NotSupported):  # no NVLink on this board
                pynvml.nvmlDeviceGetNvLinkState(h0, 0)
        finally:
            pynvml.nvmlShutdown()
        assert "nvmlDeviceGetMemoryInfo_v2" in lib.calls


def test_p2p_index_tuple_is_rejected_like_the_real_c_signature():
    # pynvml's NVML_P2P_CAPS_INDEX_READ is `0,`: passing it to the C function fails in ctypes
    with installed(machine(2)):
        pynvml.nvmlInit()
        try:
            a, b = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
            with pytest.raises(ctypes.ArgumentError):
                pynvml.nvmlDeviceGetP2PStatus(a, b, pynvml.NVML_P2P_CAPS_INDEX_READ)
            assert pynvml.nvmlDeviceGetP2PStatus(a, b, 0) == pynvml.NVML_P2P_STATUS_OK
        finally:
            pynvml.nvmlShutdown()


def test_old_driver_lacks_functions_and_lost_gpu_errors():
    m = machine(1)
    m.missing = list(OLD_DRIVER_MISSING)
    with installed(m) as lib:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            with pytest.raises(pynvml.NVMLError_FunctionNotFound):
                pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
            assert pynvml.nvmlDeviceGetMemoryInfo(h).total == 80 * GIB
            lib.lose(0)
            with pytest.raises(pynvml.NVMLError_GpuIsLost):
                pynvml.nvmlDeviceGetUtilizationRates(h)
        finally:
            pynvml.nvmlShutdown()


def test_no_driver_fails_init():
    with no_nvml(), pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()
