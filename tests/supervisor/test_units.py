"""Fast unit tests of the supervisor's pure parts: device planning, line splitting,
console filtering/collapsing, heartbeats, the CLI mapping and the worker environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from gpuherd.config import SystemConfig, preset
from gpuherd.status_records import from_object as rec
from supervisor.cli import parse
from supervisor.output.fold import LineFolder, Source
from supervisor.gpus import DeviceError, plan_devices
from supervisor.gpus import release_claims
from supervisor.health import HangPolicy, Heartbeats, LearnedTimeouts, hang_timeouts
from supervisor.health.proc_state import ProcReader
from supervisor.output.lines import LineSplitter, Severity
from supervisor.processes.worker_env import RunEnv, worker_env
from tests.fake_nvml import GIB, FakeProcess, installed, machine, no_nvml
from tests.supervisor.helpers import wait_for


@pytest.fixture
def four_gpus(tmp_path, monkeypatch):
    """Device planning runs the real GPU adapter against the fake NVML (4 GPUs)."""
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))
    m = machine(4)
    with installed(m):
        yield m
    release_claims()


def test_no_gpu_means_cpu_workers_with_a_notice():
    with no_nvml():
        plan = plan_devices(SystemConfig(nproc=3), None, nproc_explicit=True)
    assert [s.tag for s in plan.slots] == ["CPU0", "CPU1", "CPU2"] and "no GPU found" in plan.notice


def test_all_gpus_isolated_by_default_and_gpus_flag_keeps_its_order(four_gpus):
    plan = plan_devices(SystemConfig(), None, nproc_explicit=False)
    assert [s.tag for s in plan.slots] == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert plan.visible_devices(plan.slots[2]) == "2"
    release_claims()
    plan = plan_devices(SystemConfig(gpus=[2, 0], isolate=False), None, nproc_explicit=False)
    assert [(s.rank, s.device_id) for s in plan.slots] == [(0, 2), (1, 0)]
    assert plan.visible_devices(plan.slots[1]) == "2,0"


def test_cuda_visible_devices_by_id_or_uuid_restricts_the_choice(four_gpus):
    uuid1 = four_gpus.gpus[1].uuid
    plan = plan_devices(SystemConfig(), f"3,{uuid1[:12]}", nproc_explicit=False)
    assert [s.device_id for s in plan.slots] == [3, 1]
    assert plan_devices(SystemConfig(), "-1", nproc_explicit=False).kind == "cpu"
    with pytest.raises(DeviceError, match="GPU 0") as err:
        plan_devices(SystemConfig(gpus=[0]), "3,1", nproc_explicit=False)
    assert err.value.exit_code == 2


def test_nproc_busy_and_forced_cuda_errors(four_gpus):
    assert len(plan_devices(SystemConfig(nproc=2), None, nproc_explicit=True).slots) == 2
    release_claims()
    with pytest.raises(DeviceError, match="more workers than the 4") as err:
        plan_devices(SystemConfig(nproc=5), None, nproc_explicit=True)
    assert err.value.exit_code == 2
    four_gpus.gpus[0].processes.append(FakeProcess(1, 20 * GIB))
    with pytest.raises(DeviceError, match="GPU 0 is busy") as err:
        plan_devices(SystemConfig(gpus=[0]), None, nproc_explicit=False)
    assert err.value.exit_code == 2
    assert plan_devices(SystemConfig(gpus=[0]), None, nproc_explicit=False, force=True).slots[0].device_id == 0
    with no_nvml(), pytest.raises(DeviceError, match="system.device=cuda but no GPU"):
        plan_devices(SystemConfig(device="cuda"), None, nproc_explicit=False)


def test_train_gpu_on_a_machine_without_gpu_is_exit_2():
    with no_nvml(), pytest.raises(DeviceError, match="GPU 3 requested but no GPU is usable") as err:
        plan_devices(SystemConfig(device_id=3), None, nproc_explicit=False)
    assert err.value.exit_code == 2


def test_line_splitter_partial_lines_crlf_and_progress_bars():
    sp = LineSplitter(progress_interval=1.0)
    assert sp.feed(b"one\ntw", 0.0) == [b"one"]
    assert sp.feed(b"o\r", 0.0) == []  # maybe half of \r\n
    assert sp.feed(b"\nthree\n", 0.0) == [b"two", b"three"]
    assert sp.feed(b"\r 10%", 0.0) == []
    assert sp.feed(b"\r 20%", 5.0) == [b" 10%"]  # a redraw, at most once per interval
    assert sp.feed(b"\r 30%", 5.1) == []
    assert sp.feed(b"\r100%\n", 5.2) == [b"100%"]
    assert sp.feed(b"no newline at the end", 6.0) == [] and sp.finish() == [b"no newline at the end"]
    long = LineSplitter(max_line=10)
    assert long.feed(b"x" * 25, 0.0) == [b"x" * 25]


def test_severity_sees_levels_tracebacks_and_torch_warnings():
    sev = Severity()
    lines = [b"INFO | fine", b"WARNING | careful", b"Traceback (most recent call last):", b'  File "x.py", line 1',
             b"RuntimeError: boom", b"INFO | after", b"[W socket.cpp:123] slow", b"plain text"]
    assert [sev.loud(line) for line in lines] == [False, True, True, True, True, False, True, False]


def test_folder_merges_identical_lines_and_keeps_order():
    g0, g1, g2 = (Source(b"GPU%d:" % i, "GPU", i, i) for i in range(3))
    c = LineFolder([g0, g1, g2], gap=1.0, longest=1.0)
    c.add(2, g0, b"INFO | [GPU 0] model ready", 0.0)
    c.add(2, g1, b"INFO | [GPU 1] model ready", 0.1)
    c.add(2, g1, b"INFO | only me", 0.1)
    c.add(2, g2, b"INFO | [GPU 2] model ready", 0.2)
    assert c.due(0.2) == [(2, b"GPU[0-2]:INFO | [GPU *] model ready\n")]
    assert c.due(0.5) == []  # 'only me' waits for its twins...
    assert c.due(1.2) == [(2, b"GPU1:INFO | only me\n")]  # ...until the window ends
    c.add(2, g0, b"same", 2.0)
    c.add(2, g0, b"same", 2.0)  # a rank repeating itself is two lines, not two ranks
    c.add(2, g1, b"same", 2.0)
    assert c.due(9.0) == [(2, b"GPU[0-1]:same\n"), (2, b"GPU0:same\n")]


def _heartbeats(ranks: list[int], hang: float, startup: float, rendezvous: float, expect: bool) -> Heartbeats:
    timeouts = LearnedTimeouts(HangPolicy(step_default=hang, startup=startup, factor=5, floor=10, override=hang))
    return Heartbeats(ranks, now=0.0, timeouts=timeouts, rendezvous=rendezvous, expect_heartbeats=expect)


def test_heartbeats_name_the_straggler_and_rendezvous_stragglers():
    hb = _heartbeats([0, 1], hang=10, startup=100, rendezvous=30, expect=True)
    assert hb.check(50.0, {0, 1}) is None  # startup allowance
    for r in (0, 1):
        hb.record(r, rec({"type": "step", "step": 1}), 60.0)
    hb.record(0, rec({"type": "step", "step": 2}), 75.0)
    v = hb.check(75.0, {0, 1})
    assert v.kind == "hang" and v.rank == 1 and "rank 0=2, rank 1=1" in v.message
    hb = _heartbeats([0, 1], hang=10, startup=1000, rendezvous=30, expect=True)
    hb.record(0, rec({"type": "phase", "name": "rendezvous"}), 1.0)
    hb.record(0, rec({"type": "phase", "name": "init"}), 2.0)
    hb.record(1, rec({"type": "ready"}), 2.0)
    v = hb.check(40.0, {0, 1})
    assert v.kind == "rendezvous" and v.rank == 1 and "rank 1 (no step yet) never joined" in v.message
    silent = _heartbeats([0], hang=1, startup=1, rendezvous=1, expect=False)
    assert silent.check(100.0, {0}) is None  # a script that never uses the channel is not judged by it


def test_a_group_rebuilt_long_after_the_first_gets_its_own_rendezvous_allowance():
    """A shrink, then a regrow minutes later, with no spare promoted on this node (another
    node's): the regrow's rendezvous is judged from its own start, not the shrink's."""
    hb = _heartbeats([0, 1], hang=10, startup=1000, rendezvous=30, expect=True)
    for r in (0, 1):
        hb.record(r, rec({"type": "step", "step": 1}), 1.0)
    for r in (0, 1):  # the shrink: both leave the broken group and rebuild it at once
        hb.record(r, rec({"type": "phase", "name": "rendezvous"}), 2.0)
        hb.record(r, rec({"type": "phase", "name": "train"}), 2.5)
        hb.record(r, rec({"type": "step", "step": 2}), 3.0)
    for t in range(4, 300, 5):
        for r in (0, 1):
            hb.record(r, rec({"type": "step", "step": t}), float(t))
    for r in (0, 1):  # the regrow, 300 s later
        hb.record(r, rec({"type": "phase", "name": "rendezvous"}), 300.0)
    assert hb.check(301.0, {0, 1}) is None
    v = hb.check(331.0, {0, 1})
    assert v is not None and v.kind == "rendezvous"  # and it is judged: 30 s of its own


def test_heartbeats_wait_for_a_saver_name_a_stopped_rank_and_say_who_is_unwatched():
    hb = _heartbeats([0, 1], hang=10, startup=100, rendezvous=30, expect=False)
    for r in (0, 1):
        hb.record(r, rec({"type": "step", "step": 1}), 1.0)
    hb.record(0, rec({"type": "phase", "name": "checkpoint"}), 2.0)
    assert hb.check(50.0, {0, 1}) is None  # rank 1 may be waiting for the saver: the long allowance
    hb.record(0, rec({"type": "phase", "name": "train"}), 60.0)
    assert hb.check(75.0, {0, 1}).rank == 1  # stuck longest
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        reader = ProcReader()
        reader.watch(0, stopped.pid)
        assert wait_for(lambda: psutil.Process(stopped.pid).status() == psutil.STATUS_STOPPED)
        v = hb.check(76.0, {0, 1}, reader.read())  # the kernel's view, read now
        assert v.rank == 0 and "process stopped (state T)" in v.message  # evidence beats step counts
    finally:
        stopped.kill()
        stopped.wait()
    silent = _heartbeats([0, 1], hang=1, startup=5, rendezvous=1, expect=False)
    silent.record(1, rec({"type": "step", "step": 1}), 1.0)
    assert silent.newly_unwatched(4.0, {0, 1}) == []
    assert silent.newly_unwatched(6.0, {0, 1}) == [0] and silent.newly_unwatched(9.0, {0, 1}) == []  # once


def test_hang_defaults_follow_the_preset():
    assert hang_timeouts("debug", 0, 0, script=False) == (60.0, 300.0)
    assert hang_timeouts("production", 0, 0, script=False) == (600.0, 1800.0)
    assert hang_timeouts("debug", 5, 7, script=True) == (5, 7)


def test_cli_maps_flags_onto_system_config_and_script_takes_the_rest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    launch = parse(["--debug", "--nproc", "3", "--gpus", "0,2", "--hang-timeout", "9", "--grace-period", "2",
                    "--log-ranks", "0", "--collapse-logs", "--script", "train.py", "--debug", "--lr", "1"])
    s = launch.config.system
    assert (s.nproc, s.gpus, s.hang_timeout, s.grace_period, s.log_ranks, s.collapse_logs, s.isolate) == \
        (3, [0, 2], 9.0, 2.0, [0], True, False)  # isolation off by default for --script
    assert (launch.script.target, launch.script.args) == ("train.py", ["--debug", "--lr", "1"])
    assert parse(["--debug"]).config.system.isolate is True
    assert parse(["--isolate", "--script", "train.py"]).config.system.isolate is True
    positional = parse(["--nproc", "3", "train.py", "--nproc", "1", "--script", "x"])  # torchrun-style
    assert (positional.script.target, positional.script.args) == ("train.py", ["--nproc", "1", "--script", "x"])
    assert positional.config.system.nproc == 3
    assert positional.config.system.standbys is True  # restart standbys: on unless --no-standbys
    assert parse(["--no-standbys", "train.py"]).config.system.standbys is False


def test_worker_env_isolates_one_gpu_per_worker(four_gpus):
    plan = plan_devices(preset("debug").system, "0,1", nproc_explicit=False)
    run = RunEnv("r1", "/runs/r1", "127.0.0.1", 1234, 99, "/runs/r1/config.json", "/cache/x")
    env = worker_env({"PATH": "/bin"}, plan, plan.slots[1], run, status_fd=7)
    assert (env["RANK"], env["WORLD_SIZE"], env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == \
        ("1", "2", "1", "PCI_BUS_ID")
    assert (env["GPUHERD_STATUS_FD"], env["GPUHERD_DEVICE_UUID"], env["GPUHERD_DATASET_CACHE"]) == \
        ("7", four_gpus.gpus[1].uuid, "/cache/x")
    assert env["OMP_NUM_THREADS"] == "1" and env["MASTER_PORT"] == "1234"
    # torch's NCCL error handling (3) unless the user chose; the allocator grows segments
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    mine = worker_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64",
                       "CUDA_DEVICE_ORDER": "FASTEST_FIRST"}, plan, plan.slots[0], run, status_fd=7)
    assert (mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"], mine["PYTORCH_CUDA_ALLOC_CONF"]) == ("1", "max_split_size_mb:64")
    assert mine["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # forced: CUDA_VISIBLE_DEVICES holds NVML's ids
