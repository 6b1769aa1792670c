"""Suspect devices (`suspect` status records, exit 8): named in summary.json and on the
console, and `--exclude-suspect-gpus` on CPU workers (nothing to exclude). The GPU side
of the exclusion runs against the fake NVML in tests/supervisor/gpus/test_exclude.py."""

from __future__ import annotations

import socket

import orjson
import pytest

from gpuherd.config import SystemConfig
from gpuherd.status_records import from_object as rec
from supervisor.cli import parse
from supervisor.gpus import DevicePlan, DeviceSlot, plan_devices
from supervisor.health import SuspectWatch
from tests.supervisor.helpers import run

FAST = ("--restart-backoff", "0.2", "--grace-period", "2")
NOTHING_TO_EXCLUDE = "--exclude-suspect-gpus: CPU workers, nothing to exclude"


def _records(run_dir, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines()
    return [r for r in map(orjson.loads, lines) if r.get("type") == kind]


def test_a_suspect_device_is_named_in_the_summary_and_the_root_cause_block(tmp_path):
    r = run(tmp_path, "train:3", "suspect:3")
    assert r.code == 8, r.err[-3000:]
    host = socket.gethostname()
    (entry,) = r.summary["suspect_devices"]
    assert entry == {"attempt": 0, "rank": 1, "device": "cpu", "gpu": None, "host": host, "transient_faults": 3,
                     "limit": 2, "step": 3, "then": "", "cause": "transient fault", "slot": 1, "uuid": "",
                     "evidence": [], "steps": [1, 2, 3]}
    assert r.summary["attempts"][0]["suspect_devices"] == [entry]
    assert r.summary["attempts"][0]["excluded_gpus"] == []
    assert f"suspect device: cpu (host {host}, rank 1): 3 transient fault(s), limit 2, last at step 3\n" in r.err
    assert "--exclude-suspect-gpus" not in r.err  # CPU workers: no GPU to leave out, no hint
    # every record is in metrics.jsonl too (top and report show them as events)
    assert [rec["transient_faults"] for rec in _records(r.run_dir, "suspect")] == [1, 2, 3]


def test_exclude_suspect_gpus_on_cpu_restarts_as_usual_and_says_so_once(tmp_path):
    r = run(tmp_path, "train:3", "suspect:3", args=("--exclude-suspect-gpus", "--max-restarts", "2", *FAST))
    assert r.code == 8, r.err[-3000:]
    s = r.summary
    assert [a["attempt"] for a in s["attempts"]] == [0, 1, 2]
    assert all(a["excluded_gpus"] == [] for a in s["attempts"])
    assert all(len(a["workers"]) == 2 for a in s["attempts"])  # the same two workers every time
    assert r.err.count(NOTHING_TO_EXCLUDE) == 1
    assert "restart 2 of 2" in r.err and s["attempts"][-1]["not_restarted"] == "all 2 restart(s) used"
    assert [d["attempt"] for d in s["suspect_devices"]] == [0, 1, 2]
    assert "rank 1, attempt 2): 3 transient fault(s)" in r.err
    assert [rec["excluded_gpus"] for rec in _records(r.run_dir, "restart")] == [[], []]


def _gpu_plan(*gpu_ids: int) -> DevicePlan:
    return DevicePlan(slots=tuple(DeviceSlot(rank=r, kind="cuda", device_id=g) for r, g in enumerate(gpu_ids)),
                      isolate=True)


def _suspect(rank: int, faults: int, step: int = 7, **extra) -> dict:
    return {"type": "suspect", "rank": rank, "time": 0.0, "step": step, "device": "cuda:0 (GPU x)", "host": "h1",
            "transient_faults": faults, "limit": 2, "stopping": False, **extra}


def test_suspects_map_ranks_to_physical_gpus_and_keep_each_ranks_latest_count():
    watch = SuspectWatch(_gpu_plan(3, 5), attempt=1)
    for record in (_suspect(1, 1, step=4), {"type": "step", "rank": 0, "step": 5}, _suspect(1, 3, step=9),
                   _suspect(0, 1), _suspect(0, "many"), {"type": "suspect", "rank": 0}):  # the last two: unreadable
        watch.observe(rec(record))
    first, second = watch.devices(exclusion_on=False)
    assert (first.rank, first.gpu, first.transient_faults, first.over_limit, first.then) == (0, 3, 1, False, "")
    assert (second.rank, second.gpu, second.transient_faults, second.step, second.attempt) == (1, 5, 3, 9, 1)
    assert second.over_limit and "exclude it with --exclude-suspect-gpus" in second.then
    assert second.line() == ("suspect device: GPU 5 (host h1, rank 1): 3 transient fault(s), limit 2, last at step 9"
                             " — exclude it with --exclude-suspect-gpus (with --max-restarts)")
    on = SuspectWatch(_gpu_plan(3, 5), attempt=0)
    on.observe(rec(_suspect(1, 3)))
    assert on.devices(exclusion_on=True)[0].then == ""  # the restart says what it did


def test_cpu_workers_have_no_gpu_to_name():
    watch = SuspectWatch(plan_devices(SystemConfig(device="cpu", nproc=2), None, nproc_explicit=True), attempt=0)
    watch.observe(rec(_suspect(1, 3, device="cpu")))
    (d,) = watch.devices(exclusion_on=False)
    assert (d.gpu, d.device, d.then) == (None, "cpu", "")


def test_the_flag_is_a_system_config_field(capsys):
    assert parse(["--exclude-suspect-gpus"]).config.system.exclude_suspect_gpus is True
    assert parse([]).config.system.exclude_suspect_gpus is False
    assert parse(["--set", "system.exclude_suspect_gpus=true"]).config.system.exclude_suspect_gpus is True
    with pytest.raises(SystemExit) as exc:
        parse(["--set", "system.exclude_suspect_gpus=sometimes"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "system.exclude_suspect_gpus" in err and "\n" not in err
