"""The one door to NVML: session handling, error meaning, per-field degradation.

Everything else in supervisor/gpus/ calls pynvml only through these helpers, so
"no driver", "old driver lacks this function", "not supported on this board"
and "the GPU fell off the bus" each mean one thing everywhere.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from loguru import logger

NA = "n/a"  # what a field reads when this device or driver cannot answer it


class NvmlUnavailable(RuntimeError):
    """No usable NVML here (no driver, CPU machine, macOS); the message says why."""


class GpuLost(RuntimeError):
    """A GPU stopped answering (NVML_ERROR_GPU_IS_LOST / RESET_REQUIRED)."""

    def __init__(self, index: int, detail: str) -> None:
        super().__init__(f"GPU {index} is lost ({detail})")
        self.index = index
        self.detail = detail


class HandleError(RuntimeError):
    """NVML cannot open device `index`: `lost` (off the bus, or answering Unknown Error, as a
    GPU off the bus often does) or not ours to use (no permission: a container or cgroup
    restricts it). Either way the other GPUs are still planned, listed and measured."""

    def __init__(self, index: int, reason: str, lost: bool) -> None:
        super().__init__(f"GPU {index}: {reason}")
        self.index, self.reason, self.lost = index, reason, lost


def load() -> ModuleType:
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("the nvidia-ml-py package (import pynvml) is not installed") from None
    return pynvml


@contextlib.contextmanager
def session() -> Iterator[ModuleType]:
    """nvmlInit ... nvmlShutdown; NVML counts nested inits, so sessions may overlap."""
    pynvml = load()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(_init_failure(pynvml, exc)) from None
    try:
        yield pynvml
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _init_failure(pynvml: ModuleType, exc: Exception) -> str:
    value = getattr(exc, "value", None)
    if value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "libnvidia-ml.so.1 not found (no NVIDIA driver installed)"
    if value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return "the NVIDIA kernel driver is not loaded"
    if value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
        return "the NVML library lacks nvmlInitWithFlags (driver far too old or not NVML)"
    if value == pynvml.NVML_ERROR_NO_PERMISSION:
        return "no permission to open the NVIDIA device files"
    return f"nvmlInit failed: {exc}"


def _mismatch(pynvml: ModuleType) -> type | tuple:
    return getattr(pynvml, "NVMLLibraryMismatchError", ())  # absent in older nvidia-ml-py


def is_missing(pynvml: ModuleType, exc: BaseException) -> bool:
    """The driver (or an older nvidia-ml-py: AttributeError) lacks this function: try an older variant."""
    return isinstance(exc, (AttributeError, *_as_tuple(_mismatch(pynvml)))) or (
        isinstance(exc, pynvml.NVMLError) and exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )


def _as_tuple(kind: type | tuple) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def is_unsupported(pynvml: ModuleType, exc: BaseException) -> bool:
    """This device/driver will never answer this call: stop asking."""
    return is_missing(pynvml, exc) or (
        isinstance(exc, pynvml.NVMLError)
        and exc.value in (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION)
    )


def is_lost(pynvml: ModuleType, exc: BaseException) -> bool:
    return isinstance(exc, pynvml.NVMLError) and exc.value in (
        pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_RESET_REQUIRED,
    )


def handle_by_index(pynvml: ModuleType, index: int) -> Any:
    """nvmlDeviceGetHandleByIndex, with the failures a real machine gives as HandleError."""
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError as exc:
        if is_lost(pynvml, exc) or exc.value == pynvml.NVML_ERROR_UNKNOWN:
            raise HandleError(index, f"lost (NVML: {exc})", lost=True) from None
        if exc.value == pynvml.NVML_ERROR_NO_PERMISSION:
            raise HandleError(index, f"no permission to open it (NVML: {exc}); a container or cgroup "
                                     "restricts this device", lost=False) from None
        raise


def handles(pynvml: ModuleType) -> tuple[dict[int, Any], dict[int, HandleError]]:
    """({index: handle} of every GPU NVML can open, {index: why not} of the others)."""
    opened, failed = {}, {}
    for index in range(pynvml.nvmlDeviceGetCount()):
        try:
            opened[index] = handle_by_index(pynvml, index)
        except HandleError as exc:
            failed[index] = exc
    return opened, failed


def mig_enabled(pynvml: ModuleType, handle: Any) -> bool:
    """MIG mode is on now (boards and drivers without MIG: False)."""
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except Exception as exc:
        if is_unsupported(pynvml, exc):
            return False
        raise
    return int(current) == int(getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1))


def first_available(pynvml: ModuleType, *calls: Callable[[], Any]) -> Any:
    """Newest API first; fall back to older ones only when the driver lacks the newer."""
    for call in calls[:-1]:
        try:
            return call()
        except Exception as exc:
            if not is_missing(pynvml, exc):
                raise
    return calls[-1]()


def memory_info(pynvml: ModuleType, handle: Any) -> tuple[int, int, int]:
    """(total, used, free) bytes. v2 first: v1 counts reserved memory as used on R510+."""
    mem = first_available(
        pynvml,
        lambda: pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2),
        lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
    )
    return int(mem.total), int(mem.used), int(mem.free)


# Linux never hands out a pid above 2^22 (PID_MAX_LIMIT) nor pid 0 to a process.
PID_MAX_LIMIT = 4_194_304
_implausible_told: set[int] = set()


def compute_processes(pynvml: ModuleType, handle: Any) -> list[tuple[int, int | None]]:
    """[(pid, used bytes or None)] of compute processes on this GPU (v3, else v2).

    nvidia-ml-py's v3 process struct differs between driver branches (the range
    requirements.txt allows spans both): entries past the first are then read at the
    wrong offset and come out as pid 0 or 4294967295. Such pids are dropped, with one
    note per GPU, instead of becoming a phantom "other process" that makes a GPU busy."""
    procs = first_available(
        pynvml,
        lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle),
        lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v2(handle),
    )
    found = [(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory)) for p in procs]
    plausible = [(pid, used) for pid, used in found if 0 < pid < PID_MAX_LIMIT]
    if len(plausible) < len(found) and handle_address(handle) not in _implausible_told:
        _implausible_told.add(handle_address(handle))
        bad = sorted({pid for pid, _ in found if not 0 < pid < PID_MAX_LIMIT})
        logger.info(f"NVML listed impossible process ids {bad} on a GPU (its process struct does not match "
                    "this driver); ignoring those entries")
    return plausible


def handle_address(handle: Any) -> int:
    """A device handle's identity (handles are opaque pointers; compare their addresses)."""
    import ctypes

    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class FieldReader:
    """Reads one metric of one GPU; an unsupported field becomes "n/a" for good,
    logged once, so one old board or driver never silences the other fields."""

    def __init__(self, pynvml: ModuleType, log: Callable[[str], None] | None = None) -> None:
        self._pynvml = pynvml
        self._off: set[tuple[int, str]] = set()
        self._told: set[tuple[int, str]] = set()
        self._log = log or logger.info
        self._lock = threading.Lock()

    def disabled(self, index: int, field: str) -> bool:
        return (index, field) in self._off

    def read(self, index: int, field: str, *calls: Callable[[], Any]) -> Any:
        if (index, field) in self._off:
            return NA
        try:
            return first_available(self._pynvml, *calls)
        except Exception as exc:
            if is_lost(self._pynvml, exc):
                raise GpuLost(index, f"NVML: {exc}") from None
            if not isinstance(exc, (self._pynvml.NVMLError, AttributeError, *_as_tuple(_mismatch(self._pynvml)))):
                raise
            unsupported = is_unsupported(self._pynvml, exc)
            with self._lock:
                if unsupported:
                    self._off.add((index, field))
                first = (index, field) not in self._told
                self._told.add((index, field))
            if first:
                if unsupported:
                    self._log(f"GPU {index}: {field} unsupported on this GPU or driver (NVML: {exc}); "
                              "reported as n/a from now on")
                else:
                    self._log(f"GPU {index}: reading {field} failed (NVML: {exc}); n/a for this sample")
            return NA
