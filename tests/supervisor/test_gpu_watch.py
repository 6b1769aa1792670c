"""The GPU adapter joined to a run (supervisor/health/gpu_watch.py), against the fake NVML."""

from __future__ import annotations

from pathlib import Path

import pytest
from loguru import logger

from gpuherd.config import preset
from supervisor.gpus import plan_devices
from supervisor.health.gpu_watch import GpuWatcher, announce_devices
from supervisor.gpus import release_claims
from supervisor.health.watchers import RunContext
from tests.fake_nvml import installed, machine
from tests.supervisor.gpus.helpers import wait_for


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))
    m = machine(2, sockets=2)
    with installed(m) as lib:
        yield lib
    release_claims()


def _logged() -> tuple[list[str], int]:
    lines: list[str] = []
    return lines, logger.add(lambda msg: lines.append(msg.record["message"]), level="DEBUG")


def test_device_table_and_topology_warning_at_start(two_gpus):
    plan = plan_devices(preset("debug").system, None, nproc_explicit=False)
    assert [g.uuid for g in plan.gpus] == [s.uuid for s in plan.slots]
    lines, sink = _logged()
    try:
        announce_devices(plan)
    finally:
        logger.remove(sink)
    text = "\n".join(lines)
    assert plan.gpus[0].short_uuid in text and plan.gpus[1].short_uuid in text
    assert "SYS" in text  # the two GPUs sit on different sockets: seed 000's warning


def test_a_lost_gpu_mid_run_is_a_fatal_cause_with_exit_4(two_gpus, tmp_path: Path):
    system = preset("debug").system
    system.monitor_interval = 0.05
    cfg = preset("debug")
    cfg.system = system
    plan = plan_devices(system, None, nproc_explicit=False)
    records, fatals = [], []
    ctx = RunContext(config=cfg, plan=plan, run_dir=tmp_path, pids={}, write_metric=records.append,
                     report_fatal=fatals.append)
    watcher = GpuWatcher()
    watcher.start(ctx)
    try:
        assert wait_for(lambda: any(r.get("type") == "gpu" for r in records))
        two_gpus.lose(1)
        assert wait_for(lambda: bool(fatals))
    finally:
        watcher.stop()
    assert fatals[0].exit_code == 4 and "GPU 1" in fatals[0].message and "rank 1" in fatals[0].message
