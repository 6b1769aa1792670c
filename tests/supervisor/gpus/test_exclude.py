"""`--exclude-suspect-gpus` against the fake NVML: after an exit 8 the next attempt's plan
drops the suspect GPUs (one worker fewer each), and none left is refused with exit 8."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from gpuherd.config import SystemConfig
from gpuherd.exit_codes import ExitCode
from gpuherd.status_records import from_object as rec
from supervisor.gpus import DeviceError, exclude_gpus, plan_devices, release_claims
from supervisor.health import SuspectWatch
from supervisor.restarts import exclude_suspects, mark_excluded
from supervisor.summary import RootCause
from tests.fake_nvml import installed, machine, subprocess_env
from tests.supervisor.helpers import SCENARIO, env, run_dir_of

EXIT_8 = RootCause("worker-exit", ExitCode.DEVICE_SUSPECT, "GPU2 (rank 2) exit code 8")


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUHERD_LOCK_DIR", str(tmp_path / "locks"))
    yield tmp_path / "locks"
    release_claims()


def _suspects(plan, *rank_faults: tuple[int, int]):
    watch = SuspectWatch(plan, attempt=0)
    for rank, faults in rank_faults:
        watch.observe(rec({"type": "suspect", "rank": rank, "step": 11, "device": "cuda:0", "host": "h1",
                       "transient_faults": faults, "limit": 2, "stopping": True}))
    return watch.devices(exclusion_on=True)


def test_the_plan_without_a_suspect_gpu_has_one_worker_fewer_in_rank_order():
    with installed(machine(4)):
        plan = plan_devices(SystemConfig(isolate=False), None, nproc_explicit=False)
        shrunk = exclude_gpus(plan, {2})
    assert [(s.rank, s.device_id) for s in shrunk.slots] == [(0, 0), (1, 1), (2, 3)]
    assert shrunk.world_size == 3 and [g.index for g in shrunk.gpus] == [0, 1, 3]
    assert shrunk.visible_devices(shrunk.slots[0]) == "0,1,3"  # --no-isolate: every GPU left, none other
    assert [s.uuid for s in shrunk.slots] == [plan.slots[i].uuid for i in (0, 1, 3)]


def test_exit_8_restarts_without_the_gpus_over_the_limit(tmp_path):
    with installed(machine(4)):
        plan = plan_devices(SystemConfig(), None, nproc_explicit=False)
    suspects = _suspects(plan, (2, 3), (0, 1))  # rank 0's GPU had one fault: under the limit, kept
    exclusion = exclude_suspects(plan, EXIT_8, suspects, 1, enabled=True)
    shrunk = exclusion.plan
    assert [s.device_id for s in shrunk.slots] == [0, 1, 3] and shrunk.world_size == 3
    assert exclusion.gpus == (2,) and exclusion.refused is None
    assert exclusion.said == ("--exclude-suspect-gpus: attempt 1 runs without GPU 2 (3 transient faults, limit 2): "
                              "world size 4 -> 3 (GPU 0, GPU 1, GPU 3)",)
    mark_excluded(suspects, exclusion.gpus, 1)
    assert [d.then for d in suspects] == ["", "excluded from attempt 1 on"]
    # without the flag, or after another failure, the devices stay as they were
    assert exclude_suspects(plan, EXIT_8, suspects, 1, enabled=False).plan is plan
    crash = RootCause("worker-exit", ExitCode.FAILURE, "GPU2 (rank 2) exit code 1")
    assert exclude_suspects(plan, crash, suspects, 1, enabled=True).plan is plan


def test_no_gpu_left_is_refused_with_exit_8():
    with installed(machine(4)):
        plan = plan_devices(SystemConfig(gpus=[1, 3]), None, nproc_explicit=False)
    with pytest.raises(DeviceError) as err:
        exclude_gpus(plan, {1, 3})
    assert err.value.exit_code == ExitCode.DEVICE_SUSPECT
    exclusion = exclude_suspects(plan, EXIT_8, _suspects(plan, (0, 3), (1, 4)), 1, enabled=True)
    assert exclusion.plan is plan and exclusion.gpus == ()
    assert exclusion.refused.startswith("--exclude-suspect-gpus: no GPU left for another attempt: every GPU this "
                                        "attempt ran on is suspect (GPU 1, GPU 3)")
    assert exclusion.refused == str(err.value)


def _supervise(tmp_path, n_gpus: int, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The real supervisor on `n_gpus` fake GPUs, running the scenario worker."""
    cmd = [sys.executable, "-m", "supervisor", "--skip-checks", "--restart-backoff", "0.2", *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(machine(n_gpus), tmp_path, env()),
                          capture_output=True, text=True, timeout=120)
    return proc, orjson.loads((run_dir_of(tmp_path) / "summary.json").read_bytes())


def test_a_real_run_restarts_on_the_gpus_left(tmp_path):
    proc, s = _supervise(tmp_path, 3, "--report", "--exclude-suspect-gpus", "--max-restarts", "1",
                         "--script", str(SCENARIO), "train:3", "suspect:3:1", "train:3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = s["attempts"]
    assert first["exit_code"] == 8 and first["excluded_gpus"] == [] and second["excluded_gpus"] == [1]
    assert [w["device"] for w in second["workers"]] == ["GPU0", "GPU2"]
    (suspect,) = s["suspect_devices"]
    assert (suspect["gpu"], suspect["rank"], suspect["then"]) == (1, 1, "excluded from attempt 1 on")
    assert "attempt 1 runs without GPU 1 (3 transient faults, limit 2): world size 3 -> 2 (GPU 0, GPU 2)" \
        in proc.stderr
    records = [orjson.loads(line) for line in (run_dir_of(tmp_path) / "metrics.jsonl").read_bytes().splitlines()]
    (restart,) = [r for r in records if r["type"] == "restart"]
    assert (restart["excluded_gpus"], restart["world_size"]) == ([1], 2)
    page = (run_dir_of(tmp_path) / "report" / "report.html").read_text()  # `gpuherd report` shows them
    assert "GPU 1 (rank 1, attempt 0: 3 transient faults, limit 2), excluded from attempt 1 on" in page
    assert "without suspect GPU 1, world size 2" in page


def test_without_the_flag_exit_8_restarts_on_the_same_gpus_and_names_the_device(tmp_path):
    proc, s = _supervise(tmp_path, 2, "--no-report", "--max-restarts", "1", "--script", str(SCENARIO), "train:3", "suspect:3:1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [w["device"] for w in s["attempts"][1]["workers"]] == ["GPU0", "GPU1"]
    assert ", attempt 0): 3 transient fault(s), limit 2, last at step 3 — exclude it with --exclude-suspect-gpus" \
        in proc.stderr
    assert "suspect device: GPU 1 (host " in proc.stderr


def test_a_real_run_with_every_gpu_suspect_ends_with_exit_8(tmp_path):
    proc, s = _supervise(tmp_path, 2, "--no-report", "--gpus", "1", "--exclude-suspect-gpus", "--max-restarts", "2",
                         "--script", str(SCENARIO), "suspect:3")
    assert proc.returncode == 8, proc.stderr[-3000:]
    (attempt,) = s["attempts"]
    assert attempt["not_restarted"].startswith("--exclude-suspect-gpus: no GPU left for another attempt")
    assert "not restarted: --exclude-suspect-gpus: no GPU left" in proc.stderr
