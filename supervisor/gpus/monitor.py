"""GpuMonitor: GPU health tied to the worker on each GPU, for the length of a run.

Two daemon threads. The sampler reads, every `interval` seconds and per GPU:
utilization, memory (v2), temperature and slowdown threshold, SM clock, power and limit,
clock-event (throttle) reasons, volatile ECC counts, and the memory each
worker process holds; plus host CPU and RSS per worker pid (psutil). The event
thread blocks in nvmlEventSetWait_v2 (200 ms slices, so stop() is prompt) for
XID critical errors and double-bit ECC errors.

Every sample becomes a record for `sink` (the supervisor appends them to
metrics.jsonl): {"type": "gpu", ...} per GPU and {"type": "host", ...} per
worker. Trouble is named by GPU and rank: `warn` for throttling (thermal, hardware
slowdown, power brake; not the power cap a GPU at full load sits at), corrected ECC
errors, application XIDs, a foreign process on a worker's GPU (each once per
episode); memory use is recorded, not judged (nvml_meaning.py says why);
`fatal(message, ExitCode.DEVICE)` once for a lost
GPU, a hardware XID or an uncorrectable ECC error, after which the monitor
stops sampling and the supervisor tears the run down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
from loguru import logger

from gpuherd.exit_codes import ExitCode
from supervisor.gpus import nvml, nvml_meaning, pids
from supervisor.gpus.inventory import GpuInfo, process_info

EVENT_WAIT_MS = 200  # stop() joins within about this


class GpuMonitor:
    def __init__(
        self,
        gpus: list[GpuInfo],
        rank_of_gpu: dict[int, int],
        worker_pids: Callable[[], dict[int, int]],  # rank -> pid
        sink: Callable[[dict], None],
        warn: Callable[[str], None],
        fatal: Callable[[str, int], None],
        interval: float = 5.0,
        verbose: bool = False,
        console: Callable[[str], None] | None = None,  # verbose line; default loguru INFO
    ) -> None:
        self.gpus = list(gpus)
        self.rank_of_gpu = dict(rank_of_gpu)
        self.worker_pids = worker_pids
        self.sink, self.warn, self.fatal = sink, warn, fatal
        self.interval = interval
        self.verbose = verbose
        self.console = console or logger.info
        self.nvml_available = False
        self._pynvml: Any = None
        self._handles: dict[int, Any] = {}  # GPU index -> NVML handle
        self._reader: nvml.FieldReader | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._failed = threading.Event()
        self._fail_lock = threading.Lock()
        self._active: set[tuple[int, str]] = set()  # warning episodes in progress
        self._ecc_seen: dict[int, tuple[Any, Any]] = {}
        self._foreign_told: set[tuple[int, int]] = set()
        self._procs: dict[int, psutil.Process] = {}
        self._static: dict[tuple[int, str], Any] = {}  # thresholds and limits: read once
        self._unwatched: set[int] = set()  # GPUs NVML would not open (said once at start)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self.gpus:
            self._open_nvml()
        else:
            logger.info("GPU monitoring off: no GPU in this run; recording host CPU and memory per worker")
        self._spawn(self._sample_loop, "gpuherd-gpu-sampler")
        if self.nvml_available:
            self._spawn(self._event_loop, "gpuherd-gpu-events")

    def stop(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + 1.0
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        if self.nvml_available and not self._threads:
            try:
                self._pynvml.nvmlShutdown()
            except self._pynvml.NVMLError:
                pass
            self.nvml_available = False

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=self._guarded(target), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except nvml.GpuLost as exc:
                self._fail_lost(exc)
            except Exception as exc:  # monitoring must never take the run down by a bug of its own
                logger.exception("GPU monitor thread crashed")
                self.warn(f"GPU monitoring stopped after an internal error: {exc!r}")
        return run

    def _open_nvml(self) -> None:
        try:
            pynvml = nvml.load()
            pynvml.nvmlInit()
        except nvml.NvmlUnavailable as exc:
            self.warn(f"GPU monitoring off: {exc}; recording host CPU and memory per worker only")
            return
        except Exception as exc:  # NVMLError: the driver went away since planning
            self.warn(f"GPU monitoring off: nvmlInit failed ({exc}); recording host CPU and memory per worker only")
            return
        self._pynvml, self.nvml_available = pynvml, True
        self._reader = nvml.FieldReader(pynvml)
        for gpu in self.gpus:  # by UUID: the identity, whatever the index order
            try:
                self._handles[gpu.index] = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            except pynvml.NVMLError as exc:
                if nvml.is_lost(pynvml, exc) or exc.value in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_UNKNOWN):
                    self._fail(f"{self._who(gpu.index)} is gone: NVML cannot find {gpu.uuid} ({exc})")
                else:  # e.g. no permission since planning: watch the others, say so once
                    self._unwatched.add(gpu.index)
                    self.warn(f"{self._who(gpu.index)}: not monitored, NVML cannot open it ({exc})")

    # ------------------------------------------------------------------ failure / warnings

    def _who(self, index: int) -> str:
        rank = self.rank_of_gpu.get(index)
        return f"GPU {index}" + (f" (rank {rank})" if rank is not None else "")

    def _fail(self, message: str) -> None:
        with self._fail_lock:
            if self._failed.is_set():
                return
            self._failed.set()
        self._stop.set()
        self.fatal(message, int(ExitCode.DEVICE))

    def _fail_lost(self, exc: nvml.GpuLost) -> None:
        who = self._who(exc.index) if exc.index >= 0 else "a GPU of this run"
        self._fail(f"{who} is lost ({exc.detail}): the GPU fell off the bus or needs a "
                   "reset; check `nvidia-smi` and dmesg for XID 79")

    def _episode(self, index: int, kind: str, active: bool, message: str) -> None:
        """Warn when a condition starts; stay quiet while it lasts; re-arm when it ends."""
        key = (index, kind)
        if active and key not in self._active:
            self._active.add(key)
            self.warn(message)
        elif not active:
            self._active.discard(key)

    # ------------------------------------------------------------------ sampling

    def _sample_loop(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            if self._stop.wait(self.interval):
                return

    def sample_once(self) -> list[dict]:
        """One round of records (also sent to the sink); public so tests and a
        final summary can take a sample on demand."""
        now = time.time()
        workers = dict(self.worker_pids())
        records: list[dict] = []
        if self.nvml_available:
            for gpu in self.gpus:
                if self._stop.is_set() and self._failed.is_set():
                    break
                if gpu.index in self._unwatched:
                    continue
                try:
                    records.append(self._sample_gpu(gpu, now, workers))
                except nvml.GpuLost as exc:
                    self._fail_lost(exc)
                    break
        records += self._sample_hosts(now, workers)
        for record in records:
            self.sink(record)
        if self.verbose and self.nvml_available and records:
            line = " | ".join(_compact(r) for r in records if r["type"] == "gpu")
            if line:
                self.console(line)
        return records

    def _sample_gpu(self, gpu: GpuInfo, now: float, workers: dict[int, int]) -> dict:
        p, read, i = self._pynvml, self._reader.read, gpu.index
        h = self._handles.get(i)
        if h is None:
            raise nvml.GpuLost(i, "no NVML handle")
        memory = read(i, "memory", lambda: nvml.memory_info(p, h))
        mem_used, mem_total = (memory[1], memory[0]) if memory != nvml.NA else (nvml.NA, nvml.NA)
        events = read(i, "clock event reasons",
                      lambda: p.nvmlDeviceGetCurrentClocksEventReasons(h),
                      lambda: p.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        power = read(i, "power", lambda: p.nvmlDeviceGetPowerUsage(h))
        limit = self._once(i, "power limit", lambda: p.nvmlDeviceGetEnforcedPowerLimit(h))
        record = {
            "type": "gpu", "time": now, "gpu": i, "uuid": gpu.uuid, "rank": self.rank_of_gpu.get(i),
            "util": read(i, "utilization", lambda: p.nvmlDeviceGetUtilizationRates(h).gpu),
            "mem_used": mem_used, "mem_total": mem_total,
            "temp": read(i, "temperature",
                         lambda: p.nvmlDeviceGetTemperatureV(h, p.NVML_TEMPERATURE_GPU),
                         lambda: p.nvmlDeviceGetTemperature(h, p.NVML_TEMPERATURE_GPU)),
            "temp_slowdown": self._once(i, "slowdown temperature", lambda: p.nvmlDeviceGetTemperatureThreshold(
                h, p.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
            "sm_clock_mhz": read(i, "SM clock", lambda: p.nvmlDeviceGetClockInfo(h, p.NVML_CLOCK_SM)),
            "power_w": power if power == nvml.NA else round(power / 1000, 1),
            "power_limit_w": limit if limit == nvml.NA else round(limit / 1000, 1),
            "clock_events": events if events == nvml.NA else nvml_meaning.clock_event_names(events),
            "ecc_corrected": read(i, "ECC counters", lambda: p.nvmlDeviceGetTotalEccErrors(
                h, p.NVML_MEMORY_ERROR_TYPE_CORRECTED, p.NVML_VOLATILE_ECC)),
            "ecc_uncorrected": read(i, "ECC counters", lambda: p.nvmlDeviceGetTotalEccErrors(
                h, p.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, p.NVML_VOLATILE_ECC)),
        }
        record.update(self._processes(i, h, workers))
        self._judge(record, events)
        return record

    def _once(self, index: int, field: str, call: Callable[[], Any]) -> Any:
        key = (index, field)
        if key not in self._static:
            value = self._reader.read(index, field, call)
            if value == nvml.NA and not self._reader.disabled(index, field):
                return value  # transient failure: ask again next time
            self._static[key] = value
        return self._static[key]

    def _processes(self, index: int, handle: Any, worker_pids: dict[int, int]) -> dict:
        """Memory per worker, and the processes that are not ours. NVML's pids are the host's:
        inside a container an unmatched pid is of unknown owner, not "another process"."""
        found = self._reader.read(index, "process memory", lambda: nvml.compute_processes(self._pynvml, handle))
        if found == nvml.NA:
            return {"worker_mem": nvml.NA, "foreign": nvml.NA, "unknown_owner": nvml.NA}
        rank_of_pid = {pid: rank for rank, pid in worker_pids.items()}
        owners = pids.VIEW.owners([pid for pid, _ in found], rank_of_pid)
        ours, foreign, unknown = {}, [], []
        for pid, used in found:
            kind, our_pid = owners[pid]
            if kind == pids.OURS:
                ours[str(rank_of_pid[our_pid])] = used
            else:
                (foreign if kind == pids.FOREIGN else unknown).append({"pid": pid, "mem": used})
        for item in foreign:
            if (index, item["pid"]) not in self._foreign_told:
                self._foreign_told.add((index, item["pid"]))
                self.warn(f"{self._who(index)}: another process shares this GPU: "
                          f"{process_info(item['pid'], item['mem']).describe()}")
        self._unknown_owners(index, unknown, expected=int(index in self.rank_of_gpu) - len(ours))
        return {"worker_mem": ours, "foreign": foreign, "unknown_owner": unknown}

    def _unknown_owners(self, index: int, unknown: list[dict], expected: int) -> None:
        """Our own workers may hide among pids we cannot see; more such processes than
        workers of ours on this GPU means someone else is there too (said once per GPU)."""
        if len(unknown) > max(expected, 0) and (index, -1) not in self._foreign_told:
            self._foreign_told.add((index, -1))
            listed = ", ".join(str(item["pid"]) for item in unknown)
            self.warn(f"{self._who(index)}: {len(unknown)} process(es) on this GPU (host pids {listed}) for "
                      f"{max(expected, 0)} worker(s) of this run: another container or job shares this GPU")

    def _judge(self, r: dict, events: Any) -> None:
        i, who = r["gpu"], self._who(r["gpu"])
        if events != nvml.NA:
            kind = nvml_meaning.slowdown_kind(events)
            temp = "" if r["temp"] == nvml.NA else f" at {r['temp']}C"
            if r["temp_slowdown"] != nvml.NA and temp:
                temp += f" (slowdown at {r['temp_slowdown']}C)"
            self._episode(i, "throttle", kind is not None,
                          f"{who} is throttling: {kind} slowdown ({', '.join(r['clock_events'])}){temp}")
        corrected, uncorrected = r["ecc_corrected"], r["ecc_uncorrected"]
        before = self._ecc_seen.get(i)
        self._ecc_seen[i] = (corrected, uncorrected)
        if before is None:
            return
        if uncorrected != nvml.NA and before[1] != nvml.NA and uncorrected > before[1]:
            self._fail(f"{who}: uncorrectable (double-bit) ECC error: {uncorrected - before[1]} new "
                       "since the last sample; results on this GPU cannot be trusted")
        elif corrected != nvml.NA and before[0] != nvml.NA and corrected > before[0]:
            self.warn(f"{who}: {corrected - before[0]} new corrected (single-bit) ECC errors "
                      f"({corrected} since boot); watch for XID 63/64/92")

    def _sample_hosts(self, now: float, workers: dict[int, int]) -> list[dict]:
        records = []
        for rank, pid in sorted(workers.items()):
            try:
                proc = self._procs.get(pid)
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                    proc.cpu_percent(None)  # the first reading is a baseline, 0.0
                with proc.oneshot():
                    records.append({"type": "host", "time": now, "rank": rank, "pid": pid,
                                    "cpu_percent": proc.cpu_percent(None), "rss": proc.memory_info().rss,
                                    "threads": proc.num_threads()})
            except psutil.Error:
                self._procs.pop(pid, None)  # exited; the supervisor reports that, not us
        return records

    # ------------------------------------------------------------------ events

    def _event_loop(self) -> None:
        p = self._pynvml
        wanted = p.nvmlEventTypeXidCriticalError | p.nvmlEventTypeDoubleBitEccError
        try:
            event_set = p.nvmlEventSetCreate()
        except p.NVMLError as exc:
            logger.info(f"XID/ECC events are n/a: nvmlEventSetCreate failed ({exc})")
            return
        try:
            by_address = self._register(event_set, wanted)
            if not by_address:
                logger.info("XID/ECC events are n/a on these GPUs; relying on the sampler's ECC counters")
                return
            while not self._stop.is_set():
                try:
                    data = p.nvmlEventSetWait_v2(event_set, EVENT_WAIT_MS)
                except p.NVMLError as exc:
                    if exc.value == p.NVML_ERROR_TIMEOUT:
                        continue
                    if nvml.is_unsupported(p, exc):
                        logger.info(f"XID/ECC events are n/a: nvmlEventSetWait_v2 unsupported ({exc})")
                        return
                    if nvml.is_lost(p, exc):
                        raise nvml.GpuLost(self._which_lost(), f"NVML: {exc}") from None
                    self._stop.wait(EVENT_WAIT_MS / 1000)  # transient: do not spin
                    continue
                index = by_address.get(nvml.handle_address(data.device), -1)
                self._on_event(index, int(data.eventType), int(data.eventData))
        finally:
            try:
                p.nvmlEventSetFree(event_set)
            except p.NVMLError:
                pass

    def _which_lost(self) -> int:
        for index, handle in self._handles.items():
            try:
                self._pynvml.nvmlDeviceGetUUID(handle)
            except self._pynvml.NVMLError as exc:
                if nvml.is_lost(self._pynvml, exc):
                    return index
        return -1

    def _register(self, event_set: Any, wanted: int) -> dict[int, int]:
        p, by_address = self._pynvml, {}
        for index, handle in self._handles.items():
            mask = self._reader.read(index, "XID/ECC events", lambda h=handle: p.nvmlDeviceGetSupportedEventTypes(h))
            if mask == nvml.NA or not mask & wanted:
                continue
            if self._reader.read(index, "XID/ECC events",
                                 lambda h=handle, m=mask: p.nvmlDeviceRegisterEvents(h, m & wanted, event_set)) == nvml.NA:
                continue
            by_address[nvml.handle_address(handle)] = index
        return by_address

    def _on_event(self, index: int, event_type: int, data: int) -> None:
        p, who = self._pynvml, self._who(index) if index >= 0 else "a GPU of this run"
        record = {"type": "gpu_event", "time": time.time(), "gpu": index, "rank": self.rank_of_gpu.get(index),
                  "event": "xid" if event_type & p.nvmlEventTypeXidCriticalError else "double_bit_ecc",
                  "data": data}
        self.sink(record)
        if event_type & p.nvmlEventTypeDoubleBitEccError:
            self._fail(f"{who}: double-bit ECC error reported by the driver; results on this GPU cannot be trusted")
        elif nvml_meaning.xid_is_fatal(data):
            self._fail(f"{who}: hardware XID {data} reported by the driver; see "
                       "https://docs.nvidia.com/deploy/xid-errors/ and `dmesg | grep -i xid`")
        elif data in nvml_meaning.APPLICATION_XIDS:
            self.warn(f"{who}: application XID {data} (a program on this GPU faulted, the GPU itself is fine)")
        else:
            self.warn(f"{who}: XID {data} recorded by the driver (informational; takes effect at the next GPU reset)")


def _compact(r: dict) -> str:
    """`GPU0 98% 61.2/80.0GiB 67C 612W` (n/a fields print as n/a)."""
    na = nvml.NA
    util = na if r["util"] == na else f"{r['util']}%"
    mem = na if r["mem_used"] == na else f"{r['mem_used'] / 1024**3:.1f}/{r['mem_total'] / 1024**3:.1f}GiB"
    temp = na if r["temp"] == na else f"{r['temp']}C"
    power = na if r["power_w"] == na else f"{r['power_w']:.0f}W"
    return f"GPU{r['gpu']} {util} {mem} {temp} {power}"
