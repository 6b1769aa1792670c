"""A fake libnvidia-ml at the ctypes level.

Every NVML symbol is a Python function wrapped in `ctypes.CFUNCTYPE` with the
real C signature (nvml.h), so the *unchanged* pynvml code marshals real
structs, byref pointers and error codes through it. A symbol the "driver"
lacks is simply absent: pynvml's `getattr(nvmlLib, name)` fails and it raises
NVML_ERROR_FUNCTION_NOT_FOUND exactly as with an old real driver. Wrong
argument types (e.g. pynvml's tuple `NVML_P2P_CAPS_INDEX_READ`) fail in ctypes
as they would against the real library.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from ctypes import CFUNCTYPE, POINTER, c_char_p, c_int, c_uint, c_ulonglong, c_void_p

import pynvml

from tests.fake_nvml.machine import FakeMachine

RET = c_int  # nvmlReturn_t
DEV = c_void_p  # nvmlDevice_t (opaque pointer)
SUCCESS = pynvml.NVML_SUCCESS
HANDLE_BASE = 0x7F00_0000_1000  # fake device handle i = HANDLE_BASE + 16*i
EVENT_SET = 0x7F00_0000_9000


class FakeNvmlLibrary:
    """Stands in for `CDLL("libnvidia-ml.so.1")`; attributes are the C symbols."""

    def __init__(self, machine: FakeMachine) -> None:
        self.machine = machine
        self.calls: list[str] = []  # every symbol called, in order (for assertions)
        self.initialized = 0
        self.events: queue.Queue[tuple[int, int, int]] = queue.Queue()  # (gpu, type, data)
        self.registered: dict[int, int] = {}  # gpu -> event mask
        self._error_strings = {}  # keeps nvmlErrorString buffers alive
        self._lock = threading.Lock()
        for name, (restype, argtypes, impl) in self._symbols().items():
            if name in machine.missing:
                continue
            setattr(self, name, CFUNCTYPE(restype, *argtypes)(self._traced(name, impl)))

    # ------------------------------------------------------------------ test controls

    def inject_event(self, gpu: int, event_type: int, data: int = 0) -> None:
        self.events.put((gpu, event_type, data))

    def inject_xid(self, gpu: int, xid: int) -> None:
        self.inject_event(gpu, pynvml.nvmlEventTypeXidCriticalError, xid)

    def lose(self, gpu: int) -> None:
        self.machine.gpus[gpu].lost = True

    # ------------------------------------------------------------------ plumbing

    def _traced(self, name, impl):
        def call(*args):
            with self._lock:
                self.calls.append(name)
            if name not in ("nvmlInitWithFlags", "nvmlErrorString") and not self.initialized:
                return pynvml.NVML_ERROR_UNINITIALIZED
            try:
                return impl(*args)
            except Exception as exc:  # a bug in the fake must not look like a driver answer
                print(f"fake NVML: {name} raised {exc!r}")
                return pynvml.NVML_ERROR_UNKNOWN
        return call

    def _gpu(self, handle: int | None, symbol: str):
        """(gpu, error): the fake GPU a handle names, or the NVML error a real driver gives."""
        if handle is None or (handle - HANDLE_BASE) % 16 or not 0 <= (handle - HANDLE_BASE) // 16 < len(self.machine.gpus):
            return None, pynvml.NVML_ERROR_INVALID_ARGUMENT
        gpu = self.machine.gpus[(handle - HANDLE_BASE) // 16]
        if gpu.lost:
            return None, pynvml.NVML_ERROR_GPU_IS_LOST
        if symbol in gpu.unsupported:
            return None, pynvml.NVML_ERROR_NOT_SUPPORTED
        return gpu, SUCCESS

    def _index(self, handle: int) -> int:
        return (handle - HANDLE_BASE) // 16

    @staticmethod
    def _put_str(buf: int, size: int, text: str) -> int:
        data = text.encode()
        if len(data) + 1 > size:
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        ctypes.memmove(buf, data + b"\0", len(data) + 1)
        return SUCCESS

    def _device_getter(self, symbol, getter):
        """Symbol (device, T* out): write getter(gpu) into *out."""
        def impl(handle, out):
            gpu, err = self._gpu(handle, symbol)
            if err:
                return err
            out[0] = getter(gpu)
            return SUCCESS
        return impl

    # ------------------------------------------------------------------ the symbols

    def _symbols(self):
        m = self.machine
        P = POINTER
        pci_t, mem_t, mem2_t = pynvml.nvmlPciInfo_t, pynvml.c_nvmlMemory_t, pynvml.c_nvmlMemory_v2_t
        util_t, temp_t = pynvml.c_nvmlUtilization_t, pynvml.c_nvmlTemperature_v1_t
        proc_t, event_t = pynvml.c_nvmlProcessInfo_v3_t, pynvml.c_nvmlEventData_t

        def init(flags):
            if m.init_error:
                return m.init_error
            self.initialized += 1
            return SUCCESS

        def shutdown():
            if not self.initialized:
                return pynvml.NVML_ERROR_UNINITIALIZED
            self.initialized -= 1
            return SUCCESS

        def error_string(code):
            buf = self._error_strings.setdefault(code, ctypes.create_string_buffer(f"fake NVML error {code}".encode()))
            return ctypes.addressof(buf)

        def driver_version(buf, size):
            return self._put_str(buf, size, m.driver_version)

        def count(out):
            out[0] = len(m.gpus)
            return SUCCESS

        def handle_by_index(index, out):
            if index >= len(m.gpus):
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            if m.gpus[index].lost:
                return pynvml.NVML_ERROR_GPU_IS_LOST
            if m.gpus[index].handle_error:
                return m.gpus[index].handle_error
            out[0] = ctypes.cast(c_void_p(HANDLE_BASE + 16 * index), pynvml.c_nvmlDevice_t)
            return SUCCESS

        def handle_by_uuid(uuid, out):
            for i, gpu in enumerate(m.gpus):
                if gpu.uuid == uuid.decode():
                    return handle_by_index(i, out)
            return pynvml.NVML_ERROR_NOT_FOUND

        def string_field(symbol, attr):
            def impl(handle, buf, size):
                gpu, err = self._gpu(handle, symbol)
                return err or self._put_str(buf, size, getattr(gpu, attr))
            return impl

        def pci_info(symbol):
            def impl(handle, out):
                gpu, err = self._gpu(handle, symbol)
                if err:
                    return err
                out[0] = _pci_struct(gpu.pci_bus_id)
                return SUCCESS
            return impl

        def memory_v1(handle, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
            if err:
                return err
            # v1 counts the driver's reserved memory as used (the R510+ discrepancy)
            reserved = gpu.memory_total // 100
            out[0] = mem_t(total=gpu.memory_total, free=gpu.memory_total - gpu.memory_used - reserved,
                           used=gpu.memory_used + reserved)
            return SUCCESS

        def memory_v2(handle, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetMemoryInfo_v2")
            if err:
                return err
            if out[0].version != pynvml.nvmlMemory_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            reserved = gpu.memory_total // 100
            out[0] = mem2_t(version=out[0].version, total=gpu.memory_total, reserved=reserved,
                            free=gpu.memory_total - gpu.memory_used - reserved, used=gpu.memory_used)
            return SUCCESS

        def temperature_v(handle, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetTemperatureV")
            if err:
                return err
            if out[0].version != pynvml.nvmlTemperature_v1 or out[0].sensorType != pynvml.NVML_TEMPERATURE_GPU:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            out[0].temperature = gpu.temperature
            return SUCCESS

        def temperature(handle, sensor, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetTemperature")
            if err:
                return err
            if sensor != pynvml.NVML_TEMPERATURE_GPU:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            out[0] = gpu.temperature
            return SUCCESS

        def threshold(handle, kind, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetTemperatureThreshold")
            if err:
                return err
            if kind != pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            out[0] = gpu.slowdown_temperature
            return SUCCESS

        def ecc_total(handle, error_type, counter_type, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
            if err:
                return err
            out[0] = gpu.ecc_uncorrected if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else gpu.ecc_corrected
            return SUCCESS

        def processes(symbol):
            def impl(handle, count_p, infos):
                gpu, err = self._gpu(handle, symbol)
                if err:
                    return err
                procs = gpu.processes
                if not infos or count_p[0] < len(procs):
                    count_p[0] = len(procs)
                    return pynvml.NVML_ERROR_INSUFFICIENT_SIZE if procs else SUCCESS
                struct = _WideProcessInfo if gpu.wide_process_struct else proc_t
                entries = (struct * len(procs))(*(struct(pid=proc.pid, usedGpuMemory=proc.used_memory,
                                                         gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
                                                  for proc in procs))
                # the driver writes its own layout into the caller's array, never past its end
                room = count_p[0] * ctypes.sizeof(proc_t)
                ctypes.memmove(ctypes.cast(infos, c_void_p), entries, min(room, ctypes.sizeof(entries)))
                count_p[0] = len(procs)
                return SUCCESS
            return impl

        def common_ancestor(h1, h2, out):
            for h, sym in ((h1, "nvmlDeviceGetTopologyCommonAncestor"), (h2, "nvmlDeviceGetTopologyCommonAncestor")):
                _, err = self._gpu(h, sym)
                if err:
                    return err
            i, j = self._index(h1), self._index(h2)
            out[0] = 0 if i == j else m.topology[i][j]
            return SUCCESS

        def p2p_status(h1, h2, index, out):
            for h in (h1, h2):
                _, err = self._gpu(h, "nvmlDeviceGetP2PStatus")
                if err:
                    return err
            if index > pynvml.NVML_P2P_CAPS_INDEX_UNKNOWN:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            ok = m.p2p_read_ok[self._index(h1)][self._index(h2)]
            out[0] = pynvml.NVML_P2P_STATUS_OK if ok else pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED
            return SUCCESS

        def nvlink_state(handle, link, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetNvLinkState")
            if err:
                return err
            links = m.nvlinks[self._index(handle)] if m.nvlinks else []
            if not links:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            if link >= len(links):  # past this board's last link, as the driver answers
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            out[0] = 0 if link in gpu.nvlink_down else 1
            return SUCCESS

        def nvlink_remote(handle, link, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetNvLinkRemotePciInfo_v2")
            if err:
                return err
            links = m.nvlinks[self._index(handle)] if m.nvlinks else []
            if link >= len(links):
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            out[0] = _pci_struct(links[link])
            return SUCCESS

        def pair(symbol, attr):
            """Symbol (device, T* a, T* b): the two values of a tuple field."""
            def impl(handle, a, b):
                gpu, err = self._gpu(handle, symbol)
                if err:
                    return err
                a[0], b[0] = getattr(gpu, attr)
                return SUCCESS
            return impl

        def retired_pages(handle, cause, count_p, addresses):
            gpu, err = self._gpu(handle, "nvmlDeviceGetRetiredPages")
            if err:
                return err
            n = gpu.retired_pages[cause] if cause < 2 else 0
            if not addresses or count_p[0] < n:
                count_p[0] = n
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE if n else SUCCESS
            for i in range(n):
                addresses[i] = 0x1000 * (i + 1) + cause
            count_p[0] = n
            return SUCCESS

        def remapped_rows(handle, corr, unc, pending, failure):
            gpu, err = self._gpu(handle, "nvmlDeviceGetRemappedRows")
            if err:
                return err
            corr[0], unc[0] = gpu.remapped_rows
            pending[0], failure[0] = int(gpu.remap_pending), int(gpu.remap_failure)
            return SUCCESS

        def field_values(handle, count, address):
            gpu, err = self._gpu(handle, "nvmlDeviceGetFieldValues")
            if err:
                return err
            # pynvml passes byref(array): declared void*, as ctypes cannot take it for a struct pointer
            values = ctypes.cast(address, P(pynvml.c_nvmlFieldValue_t))
            for i in range(count):
                if values[i].fieldId == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION:
                    values[i].valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
                    values[i].value.uiVal = gpu.recovery_action
                    values[i].nvmlReturn = SUCCESS
                else:
                    values[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            return SUCCESS

        def clock(symbol, attr):
            def impl(handle, kind, out):
                gpu, err = self._gpu(handle, symbol)
                if err:
                    return err
                if kind != pynvml.NVML_CLOCK_SM:
                    return pynvml.NVML_ERROR_NOT_SUPPORTED
                out[0] = getattr(gpu, attr)
                return SUCCESS
            return impl

        def event_set_create(out):
            out[0] = ctypes.cast(c_void_p(EVENT_SET), pynvml.c_nvmlEventSet_t)
            return SUCCESS

        def supported_events(handle, out):
            gpu, err = self._gpu(handle, "nvmlDeviceGetSupportedEventTypes")
            if err:
                return err
            out[0] = gpu.supported_events
            return SUCCESS

        def register_events(handle, mask, event_set):
            gpu, err = self._gpu(handle, "nvmlDeviceRegisterEvents")
            if err:
                return err
            if mask & ~gpu.supported_events:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            self.registered[self._index(handle)] = mask
            return SUCCESS

        def event_wait(event_set, data_p, timeout_ms):
            if event_set != EVENT_SET:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            try:
                gpu, event_type, data = self.events.get(timeout=timeout_ms / 1000)
            except queue.Empty:
                return pynvml.NVML_ERROR_TIMEOUT
            if not self.registered.get(gpu, 0) & event_type:
                return pynvml.NVML_ERROR_TIMEOUT  # not registered: the driver would not report it
            data_p[0] = event_t(device=ctypes.cast(c_void_p(HANDLE_BASE + 16 * gpu), pynvml.c_nvmlDevice_t),
                                eventType=event_type, eventData=data,
                                gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            return SUCCESS

        def event_set_free(event_set):
            return SUCCESS if event_set == EVENT_SET else pynvml.NVML_ERROR_INVALID_ARGUMENT

        uint_p, ull_p = P(c_uint), P(c_ulonglong)
        getter = self._device_getter
        return {
            "nvmlInitWithFlags": (RET, [c_uint], init),
            "nvmlShutdown": (RET, [], shutdown),
            "nvmlErrorString": (c_void_p, [RET], error_string),  # const char*; pynvml sets restype
            "nvmlSystemGetDriverVersion": (RET, [c_void_p, c_uint], driver_version),
            "nvmlDeviceGetCount_v2": (RET, [uint_p], count),
            "nvmlDeviceGetHandleByIndex_v2": (RET, [c_uint, P(pynvml.c_nvmlDevice_t)], handle_by_index),
            "nvmlDeviceGetHandleByUUID": (RET, [c_char_p, P(pynvml.c_nvmlDevice_t)], handle_by_uuid),
            "nvmlDeviceGetUUID": (RET, [DEV, c_void_p, c_uint], string_field("nvmlDeviceGetUUID", "uuid")),
            "nvmlDeviceGetName": (RET, [DEV, c_void_p, c_uint], string_field("nvmlDeviceGetName", "name")),
            "nvmlDeviceGetIndex": (RET, [DEV, uint_p], getter("nvmlDeviceGetIndex", lambda g: m.gpus.index(g))),
            "nvmlDeviceGetPciInfo_v3": (RET, [DEV, P(pci_t)], pci_info("nvmlDeviceGetPciInfo_v3")),
            "nvmlDeviceGetMemoryInfo": (RET, [DEV, P(mem_t)], memory_v1),
            "nvmlDeviceGetMemoryInfo_v2": (RET, [DEV, P(mem2_t)], memory_v2),
            "nvmlDeviceGetUtilizationRates": (RET, [DEV, P(util_t)], getter(
                "nvmlDeviceGetUtilizationRates", lambda g: util_t(gpu=g.utilization, memory=g.utilization // 2))),
            "nvmlDeviceGetTemperatureV": (RET, [DEV, P(temp_t)], temperature_v),
            "nvmlDeviceGetTemperature": (RET, [DEV, c_uint, uint_p], temperature),
            "nvmlDeviceGetTemperatureThreshold": (RET, [DEV, c_uint, uint_p], threshold),
            "nvmlDeviceGetPowerUsage": (RET, [DEV, uint_p], getter("nvmlDeviceGetPowerUsage", lambda g: g.power_mw)),
            "nvmlDeviceGetEnforcedPowerLimit": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetEnforcedPowerLimit", lambda g: g.power_limit_mw)),
            "nvmlDeviceGetCurrentClocksEventReasons": (RET, [DEV, ull_p], getter(
                "nvmlDeviceGetCurrentClocksEventReasons", lambda g: g.clocks_event_reasons)),
            "nvmlDeviceGetCurrentClocksThrottleReasons": (RET, [DEV, ull_p], getter(
                "nvmlDeviceGetCurrentClocksThrottleReasons", lambda g: g.clocks_event_reasons)),
            "nvmlDeviceGetTotalEccErrors": (RET, [DEV, c_uint, c_uint, ull_p], ecc_total),
            "nvmlDeviceGetComputeRunningProcesses_v3": (RET, [DEV, uint_p, P(proc_t)], processes(
                "nvmlDeviceGetComputeRunningProcesses_v3")),
            "nvmlDeviceGetComputeRunningProcesses_v2": (RET, [DEV, uint_p, P(proc_t)], processes(
                "nvmlDeviceGetComputeRunningProcesses_v2")),
            "nvmlDeviceGetTopologyCommonAncestor": (RET, [DEV, DEV, uint_p], common_ancestor),
            "nvmlDeviceGetP2PStatus": (RET, [DEV, DEV, c_uint, uint_p], p2p_status),
            "nvmlDeviceGetNvLinkState": (RET, [DEV, c_uint, uint_p], nvlink_state),
            "nvmlDeviceGetNvLinkRemotePciInfo_v2": (RET, [DEV, c_uint, P(pci_t)], nvlink_remote),
            "nvmlDeviceGetClockInfo": (RET, [DEV, c_uint, uint_p], clock("nvmlDeviceGetClockInfo", "sm_clock_mhz")),
            "nvmlDeviceGetMaxClockInfo": (RET, [DEV, c_uint, uint_p], clock(
                "nvmlDeviceGetMaxClockInfo", "sm_clock_max_mhz")),
            "nvmlDeviceGetEccMode": (RET, [DEV, uint_p, uint_p], pair("nvmlDeviceGetEccMode", "ecc_mode")),
            "nvmlDeviceGetMigMode": (RET, [DEV, uint_p, uint_p], pair("nvmlDeviceGetMigMode", "mig_mode")),
            "nvmlDeviceGetRetiredPages": (RET, [DEV, c_uint, uint_p, ull_p], retired_pages),
            "nvmlDeviceGetRetiredPagesPendingStatus": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetRetiredPagesPendingStatus", lambda g: int(g.retired_pages_pending))),
            "nvmlDeviceGetRemappedRows": (RET, [DEV, uint_p, uint_p, uint_p, uint_p], remapped_rows),
            "nvmlDeviceGetCurrPcieLinkGeneration": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetCurrPcieLinkGeneration", lambda g: g.pcie[0])),
            "nvmlDeviceGetMaxPcieLinkGeneration": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetMaxPcieLinkGeneration", lambda g: g.pcie[1])),
            "nvmlDeviceGetGpuMaxPcieLinkGeneration": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetGpuMaxPcieLinkGeneration", lambda g: g.pcie[1])),
            "nvmlDeviceGetCurrPcieLinkWidth": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetCurrPcieLinkWidth", lambda g: g.pcie[2])),
            "nvmlDeviceGetMaxPcieLinkWidth": (RET, [DEV, uint_p], getter(
                "nvmlDeviceGetMaxPcieLinkWidth", lambda g: g.pcie[3])),
            "nvmlDeviceGetFieldValues": (RET, [DEV, c_int, c_void_p], field_values),
            "nvmlEventSetCreate": (RET, [P(pynvml.c_nvmlEventSet_t)], event_set_create),
            "nvmlDeviceGetSupportedEventTypes": (RET, [DEV, ull_p], supported_events),
            "nvmlDeviceRegisterEvents": (RET, [DEV, c_ulonglong, c_void_p], register_events),
            "nvmlEventSetWait_v2": (RET, [c_void_p, P(event_t), c_uint], event_wait),
            "nvmlEventSetFree": (RET, [c_void_p], event_set_free),
        }


class _WideProcessInfo(ctypes.Structure):
    """A driver branch's v3 process entry with one more field than nvidia-ml-py's."""

    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint), ("usedGpuCcProtectedMemory", c_ulonglong)]


def _pci_struct(bus_id: str) -> pynvml.nvmlPciInfo_t:
    domain, bus, rest = bus_id.split(":")
    device = rest.split(".")[0]
    return pynvml.nvmlPciInfo_t(
        busIdLegacy=bus_id[-12:].encode(), domain=int(domain, 16), bus=int(bus, 16), device=int(device, 16),
        pciDeviceId=0x233010DE, pciSubSystemId=0x16C110DE, busId=bus_id.encode(),
    )
