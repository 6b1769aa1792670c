"""GpuMonitor against the fake NVML: records, warnings naming the rank, fatal device errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from supervisor.gpus import GpuMonitor, read_inventory
from tests.fake_nvml import GIB, OLD_DRIVER_MISSING, FakeProcess, installed, machine, no_nvml
from tests.supervisor.gpus.helpers import Recorder, captured_log, wait_for


@pytest.fixture
def worker():
    """A real process standing in for a training worker (psutil must find it)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def start(gpus, rec, pids, **kw):
    mon = GpuMonitor(gpus, {g.index: r for r, g in enumerate(gpus)}, lambda: pids, rec.sink, rec.warn,
                     rec.fatal, interval=kw.pop("interval", 0.05), console=rec.console, **kw)
    mon.start()
    return mon


def test_samples_gpu_and_host_records_and_verbose_line(worker):
    m = machine(2)
    g = m.gpus[1]
    g.utilization, g.memory_used, g.temperature, g.power_mw = 98, int(61.2 * GIB), 67, 612_000
    g.processes.append(FakeProcess(worker, 60 * GIB))
    with installed(m) as lib:
        gpus = read_inventory()
        rec = Recorder()
        mon = start([gpus[1]], rec, {0: worker}, verbose=True)
        try:
            assert wait_for(lambda: len(rec.of_type("gpu")) >= 2 and rec.of_type("host"))
        finally:
            mon.stop()
        assert not any(t.is_alive() for t in mon._threads) and lib.initialized == 0
    r = rec.of_type("gpu")[0]
    assert (r["gpu"], r["rank"], r["uuid"], r["util"], r["temp"], r["temp_slowdown"]) == (1, 0, g.uuid, 98, 67, 87)
    assert (r["mem_used"], r["mem_total"], r["power_w"], r["power_limit_w"]) == (int(61.2 * GIB), 80 * GIB, 612.0, 700.0)
    assert r["worker_mem"] == {"0": 60 * GIB} and r["foreign"] == [] and r["clock_events"] == ["idle"]
    host = rec.of_type("host")[0]
    assert host["rank"] == 0 and host["pid"] == worker and host["rss"] > 0
    assert rec.lines[0] == "GPU1 98% 61.2/80.0GiB 67C 612W"
    assert rec.warnings == [] and rec.fatals == []
    assert "nvmlDeviceGetMemoryInfo_v2" in lib.calls and "nvmlDeviceGetHandleByUUID" in lib.calls


def test_warnings_name_the_rank_once_per_episode():
    m = machine(2)
    with installed(m):
        gpus = read_inventory()
        rec = Recorder()
        mon = GpuMonitor(gpus, {0: 1, 1: 0}, dict, rec.sink, rec.warn, rec.fatal, interval=60)
        mon.start()
        try:
            assert wait_for(lambda: len(rec.of_type("gpu")) == 2)  # the thread's first sample; next in 60 s
            m.gpus[0].clocks_event_reasons = 0x40  # hw thermal slowdown
            m.gpus[0].temperature = 91
            m.gpus[1].memory_used = int(79 * GIB)
            m.gpus[1].processes.append(FakeProcess(1, GIB))
            m.gpus[1].ecc_corrected = 3
            for _ in range(3):
                mon.sample_once()
            m.gpus[0].clocks_event_reasons = 0x0
            mon.sample_once()
            m.gpus[0].clocks_event_reasons = 0x4  # the power cap an H100 at full load sits at: normal
            mon.sample_once()
            m.gpus[0].clocks_event_reasons = 0x80  # the hardware power brake: a new episode
            mon.sample_once()
        finally:
            mon.stop()
    w = rec.warnings
    assert "GPU 0 (rank 1) is throttling: thermal slowdown (hw_thermal) at 91C (slowdown at 87C)" in w
    assert "GPU 0 (rank 1) is throttling: power slowdown (hw_power_brake) at 91C (slowdown at 87C)" in w
    assert not any("sw_power_cap" in x for x in w)
    assert [r for r in rec.of_type("gpu") if r["gpu"] == 0][-2]["clock_events"] == ["sw_power_cap"]  # recorded only
    # 79 of 80 GiB is what the caching allocator of a healthy run holds: no warning
    assert not any("memory" in x for x in w)
    assert sum(x.startswith("GPU 1 (rank 0): another process shares this GPU: pid 1 ") for x in w) == 1
    # start() sampled once before the counter moved 0 -> 3: three new corrected errors
    assert "GPU 1 (rank 0): 3 new corrected (single-bit) ECC errors (3 since boot); watch for XID 63/64/92" in w
    assert len(w) == 4 and rec.fatals == []
    before = len(rec.of_type("gpu"))
    with installed(m):
        mon = GpuMonitor(gpus[1:], {1: 0}, dict, rec.sink, rec.warn, rec.fatal, interval=60)
        mon.start()
        assert wait_for(lambda: len(rec.of_type("gpu")) == before + 1)
        m.gpus[1].ecc_corrected = 5
        mon.sample_once()
        m.gpus[1].ecc_uncorrected = 1
        mon.sample_once()
        mon.stop()
    assert "GPU 1 (rank 0): 2 new corrected (single-bit) ECC errors (5 since boot); watch for XID 63/64/92" in rec.warnings
    assert rec.fatals == [("GPU 1 (rank 0): uncorrectable (double-bit) ECC error: 1 new since the last sample; "
                           "results on this GPU cannot be trusted", 4)]


@pytest.mark.parametrize(("event", "data", "fatal"), [
    ("xid", 79, "GPU 2 (rank 1): hardware XID 79 reported by the driver"),
    ("xid", 13, None),
    ("xid", 63, None),
    ("dbe", 0, "GPU 2 (rank 1): double-bit ECC error reported by the driver"),
])
def test_xid_and_ecc_events(event, data, fatal):
    with installed(machine(4, nvlink=True)) as lib:
        gpus = read_inventory()
        rec = Recorder()
        mon = GpuMonitor(gpus[1:3], {1: 0, 2: 1}, dict, rec.sink, rec.warn, rec.fatal, interval=60)
        mon.start()
        try:
            assert wait_for(lambda: len(lib.registered) == 2)
            lib.inject_event(2, 0x8 if event == "xid" else 0x2, data)
            assert wait_for(lambda: rec.of_type("gpu_event"))
            if fatal:
                assert rec.fatal_event.wait(5)
        finally:
            mon.stop()
    assert rec.of_type("gpu_event")[0]["gpu"] == 2 and rec.of_type("gpu_event")[0]["rank"] == 1
    if fatal:
        assert len(rec.fatals) == 1 and rec.fatals[0][0].startswith(fatal) and rec.fatals[0][1] == 4
    else:
        assert rec.fatals == [] and len(rec.warnings) == 1 and rec.warnings[0].startswith("GPU 2 (rank 1): ")
        assert f"XID {data}" in rec.warnings[0]


def test_gpu_lost_mid_run_is_fatal_once_naming_gpu_and_rank():
    with installed(machine(4)) as lib:
        gpus = read_inventory()
        rec = Recorder()
        mon = start(gpus, rec, {})
        try:
            assert wait_for(lambda: len(rec.of_type("gpu")) >= 4)
            lib.lose(3)
            assert rec.fatal_event.wait(5)
            assert wait_for(lambda: not any(t.is_alive() for t in mon._threads))  # it stops itself
        finally:
            mon.stop()
    (message, code), = rec.fatals
    assert code == 4 and message.startswith("GPU 3 (rank 3) is lost (NVML: GPU is lost)") and "XID 79" in message


def test_old_driver_and_unsupported_fields_degrade_to_na_once():
    m = machine(2)
    m.missing = list(OLD_DRIVER_MISSING)
    m.gpus[0].unsupported = ["nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors"]
    with installed(m) as lib, captured_log() as log:
        gpus = read_inventory()
        rec = Recorder()
        mon = GpuMonitor(gpus, {0: 0, 1: 1}, dict, rec.sink, rec.warn, rec.fatal, interval=60, verbose=True,
                         console=rec.console)
        mon.start()
        assert wait_for(lambda: len(rec.of_type("gpu")) == 2)
        for _ in range(3):
            mon.sample_once()
        # the event thread finds nvmlEventSetWait_v2 missing on its own schedule: stop only after it has
        assert wait_for(lambda: any("XID/ECC events are n/a" in x for x in log))
        mon.stop()
    g0, g1 = rec.of_type("gpu")[:2]
    assert g0["power_w"] == "n/a" and g0["ecc_corrected"] == "n/a" and g0["util"] == 0 and g0["temp"] == 35
    assert g1["power_w"] == 70.0 and g1["ecc_corrected"] == 0
    assert g0["mem_used"] == 512 * 1024**2 + 80 * GIB // 100  # v1 fallback: counts reserved memory as used
    assert "nvmlDeviceGetTemperature" in lib.calls and "nvmlDeviceGetCurrentClocksThrottleReasons" in lib.calls
    assert rec.lines[-1] == "GPU0 0% 1.3/80.0GiB 35C n/a | GPU1 0% 1.3/80.0GiB 35C 70W"
    power_notes = [x for x in log if x.startswith("GPU 0: power unsupported")]
    assert len(power_notes) == 1 and "Not Supported" in power_notes[0]
    samples_gpu1 = sum(r["gpu"] == 1 for r in rec.of_type("gpu"))
    assert lib.calls.count("nvmlDeviceGetPowerUsage") == 1 + samples_gpu1  # GPU 0 asked once, then never again
    assert any("XID/ECC events are n/a" in x for x in log)  # no nvmlEventSetWait_v2 on this driver
    assert rec.warnings == [] and rec.fatals == []


def test_without_nvml_one_notice_and_host_records_still_flow(worker):
    with no_nvml():
        rec = Recorder()
        from supervisor.gpus.inventory import GpuInfo
        gpu = GpuInfo(index=0, uuid="GPU-x", name="x", pci_bus_id="?", memory_total=1, memory_used=0)
        mon = start([gpu], rec, {0: worker})
        try:
            assert wait_for(lambda: len(rec.of_type("host")) >= 2)
        finally:
            mon.stop()
    assert len(rec.warnings) == 1 and rec.warnings[0].startswith("GPU monitoring off")
    assert rec.of_type("gpu") == [] and rec.fatals == []
    with captured_log() as log:
        rec = Recorder()
        mon = start([], rec, {0: worker})  # CPU run: nothing to warn about
        assert wait_for(lambda: rec.of_type("host"))
        mon.stop()
    assert rec.warnings == [] and sum("GPU monitoring off" in x for x in log) == 1


def test_older_nvidia_ml_py_without_newer_bindings_falls_back(monkeypatch):
    import pynvml
    monkeypatch.delattr(pynvml, "nvmlDeviceGetTemperatureV")  # as in nvidia-ml-py 12.535
    with installed(machine(1)) as lib:
        gpus = read_inventory()
        rec = Recorder()
        mon = GpuMonitor(gpus, {0: 0}, dict, rec.sink, rec.warn, rec.fatal, interval=60)
        mon.start()
        assert wait_for(lambda: rec.of_type("gpu"))
        mon.stop()
    assert rec.of_type("gpu")[0]["temp"] == 35 and "nvmlDeviceGetTemperature" in lib.calls
