"""A GPU's health before a run: the NVML readings `gpuherd check` judges.

Per GPU: ECC mode and volatile ECC counts, retired pages and their pending
status, row remapping (Ampere+), current clock-event (throttle) reasons, NVLink
link states, PCIe generation/width against their maximum, the driver's
recommended recovery action (R550+ field value), MIG mode, compute processes
and memory in use; plus the XID events the driver reports while the readings
are taken. A field this board or driver cannot answer reads `nvml.NA`, a lost
GPU comes back with `lost` set, so one old board never hides the other answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from loguru import logger

from gpuherd.errors import DeviceError
from gpuherd.exit_codes import ExitCode
from supervisor.gpus import nvml
from supervisor.gpus.inventory import GpuInfo, describe_device

NA = nvml.NA


@dataclass
class DeviceHealth:
    info: GpuInfo
    ecc_mode: Any = NA  # (current, pending): 1 enabled
    ecc_volatile: Any = NA  # (corrected, uncorrected) since the last driver load
    retired_pages: Any = NA  # (single-bit pages, double-bit pages, pending: bool)
    remapped_rows: Any = NA  # (correctable, uncorrectable, pending: bool, failure: bool)
    clock_events: Any = NA  # nvmlClocksEventReason* bit mask
    nvlinks: Any = NA  # (active links, [indices of links down]); NA: no NVLink
    pcie: Any = NA  # (generation, max generation, width, max width)
    recovery_action: Any = NA  # nvmlGpuRecoveryAction_t
    mig_mode: Any = NA  # (current, pending): 1 enabled
    xids: list[int] = field(default_factory=list)  # XID events seen while checking
    xid_events: bool = False  # False: this GPU/driver does not report XID events

    @property
    def index(self) -> int:
        return self.info.index


def read_device_health(indices: Sequence[int] | None = None) -> list[DeviceHealth]:
    """Readings for these GPU indices (None: every GPU). Raises nvml.NvmlUnavailable
    without NVML, DeviceError (exit 2) for an index the machine does not have."""
    with nvml.session() as pynvml:
        count = pynvml.nvmlDeviceGetCount()
        wanted = list(range(count)) if indices is None else list(indices)
        missing = [i for i in wanted if not 0 <= i < count]
        if missing:
            raise DeviceError(f"GPU {missing[0]} does not exist (this machine has GPUs 0-{count - 1})"
                              if count else f"GPU {missing[0]} does not exist (no GPU on this machine)",
                              ExitCode.USAGE)
        reader = nvml.FieldReader(pynvml, log=logger.debug)
        event_set, watched = _watch_xids(pynvml, reader, wanted)  # first: XIDs during the readings count
        try:
            readings = [_one(pynvml, reader, i) for i in wanted]
            by_index = {r.index: r for r in readings}
            for index in watched.values():
                by_index[index].xid_events = True
            _drain(pynvml, event_set, {address: by_index[i] for address, i in watched.items()})
        finally:
            if event_set is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(event_set)
        return readings


def _one(pynvml: ModuleType, reader: nvml.FieldReader, index: int) -> DeviceHealth:
    try:  # a GPU NVML cannot open is reported lost or unusable, never raised
        handle, failed = nvml.handle_by_index(pynvml, index), None
    except nvml.HandleError as exc:
        handle, failed = None, exc
    info = describe_device(pynvml, index, handle, failed)
    health = DeviceHealth(info)
    if info.lost or handle is None:
        return health
    try:
        _read_fields(pynvml, reader, handle, health)
    except nvml.GpuLost as exc:
        health.info = GpuInfo(index, info.uuid, info.name, info.pci_bus_id, 0, 0, None, lost=exc.detail)
    return health


def _read_fields(p: ModuleType, reader: nvml.FieldReader, h: Any, health: DeviceHealth) -> None:
    i, read = health.index, reader.read
    health.ecc_mode = read(i, "ECC mode", lambda: tuple(p.nvmlDeviceGetEccMode(h)))
    health.ecc_volatile = read(i, "ECC counters", lambda: tuple(
        p.nvmlDeviceGetTotalEccErrors(h, kind, p.NVML_VOLATILE_ECC)
        for kind in (p.NVML_MEMORY_ERROR_TYPE_CORRECTED, p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)))
    health.retired_pages = read(i, "retired pages", lambda: (
        len(p.nvmlDeviceGetRetiredPages(h, p.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)),
        len(p.nvmlDeviceGetRetiredPages(h, p.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
        bool(p.nvmlDeviceGetRetiredPagesPendingStatus(h))))
    health.remapped_rows = read(i, "row remapping", lambda: _remap(p.nvmlDeviceGetRemappedRows(h)))
    health.clock_events = read(i, "clock event reasons", lambda: p.nvmlDeviceGetCurrentClocksEventReasons(h),
                               lambda: p.nvmlDeviceGetCurrentClocksThrottleReasons(h))
    health.nvlinks = _nvlinks(p, i, h)
    health.pcie = read(i, "PCIe link", lambda: (
        p.nvmlDeviceGetCurrPcieLinkGeneration(h),
        nvml.first_available(p, lambda: p.nvmlDeviceGetGpuMaxPcieLinkGeneration(h),
                             lambda: p.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        p.nvmlDeviceGetCurrPcieLinkWidth(h), p.nvmlDeviceGetMaxPcieLinkWidth(h)))
    health.recovery_action = read(i, "recovery action", lambda: _recovery_action(p, h))
    health.mig_mode = read(i, "MIG mode", lambda: tuple(p.nvmlDeviceGetMigMode(h)))


def _remap(values: tuple) -> tuple[int, int, bool, bool]:
    corrected, uncorrected, pending, failure = values
    return int(corrected), int(uncorrected), bool(pending), bool(failure)


def _recovery_action(p: ModuleType, h: Any) -> int:
    value = p.nvmlDeviceGetFieldValues(h, [p.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
    if value.nvmlReturn != p.NVML_SUCCESS:  # a per-field answer: older drivers lack this field
        raise p.NVMLError(value.nvmlReturn)
    return int(value.value.uiVal)


def _nvlinks(p: ModuleType, index: int, h: Any) -> Any:
    """(active, [down]) over the board's links; NA when it has none (or the driver lacks the call)."""
    active, down = 0, []
    for link in range(p.NVML_NVLINK_MAX_LINKS):
        try:
            state = p.nvmlDeviceGetNvLinkState(h, link)
        except Exception as exc:
            if nvml.is_lost(p, exc):
                raise nvml.GpuLost(index, f"NVML: {exc}") from None
            if not isinstance(exc, (p.NVMLError, AttributeError)):
                raise
            break  # past the last link, or no NVLink on this board
        if state:
            active += 1
        else:
            down.append(link)
    return (active, down) if active or down else NA


def _watch_xids(p: ModuleType, reader: nvml.FieldReader, indices: list[int]) -> tuple[Any, dict[int, int]]:
    """(event set, handle address -> GPU index) registered for XID critical errors; GPUs or
    drivers without event support are left out, and their XID item reads n/a."""
    try:
        event_set = p.nvmlEventSetCreate()
    except p.NVMLError:
        return None, {}
    watched = {}
    for index in indices:
        try:
            handle = p.nvmlDeviceGetHandleByIndex(index)
        except p.NVMLError:
            continue  # lost: its own item says so
        mask = reader.read(index, "XID events", lambda h=handle: p.nvmlDeviceGetSupportedEventTypes(h))
        if mask == NA or not mask & p.nvmlEventTypeXidCriticalError:
            continue
        if reader.read(index, "XID events", lambda h=handle: p.nvmlDeviceRegisterEvents(
                h, p.nvmlEventTypeXidCriticalError, event_set)) != NA:
            watched[nvml.handle_address(handle)] = index
    return event_set, watched


def _drain(p: ModuleType, event_set: Any, by_address: dict[int, DeviceHealth]) -> None:
    """Every XID pending now, without waiting: the check must stay fast."""
    if not by_address:
        return
    while True:
        try:
            data = nvml.first_available(p, lambda: p.nvmlEventSetWait_v2(event_set, 0),
                                        lambda: p.nvmlEventSetWait(event_set, 0))
        except p.NVMLError:
            return  # timeout: nothing (more) pending
        health = by_address.get(nvml.handle_address(data.device))
        if health is not None and data.eventType & p.nvmlEventTypeXidCriticalError:
            health.xids.append(int(data.eventData))
