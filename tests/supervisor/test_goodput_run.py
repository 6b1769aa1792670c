"""summary.json's goodput against the goodput benchmark's own accounting (the steps the script
itself logged), on one short run of the benchmark's DDP script whose rank 1 is killed
mid-run and restarted: the two must agree within a few percent."""

from __future__ import annotations

import signal
import subprocess
import time

import orjson
import psutil
import pytest

from bench.goodput_accounting import from_steps_log, kept
from supervisor.goodput import CAUSES
from tests.supervisor import helpers as sh

STEPS, STEP_S = 90, 0.05


def _rank1(pid: int) -> psutil.Process | None:
    for p in sh.descendants(pid):
        try:
            if "goodput_worker.py" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1":
                return p
        except psutil.Error:
            continue
    return None


def test_summary_goodput_agrees_with_the_steps_the_script_logged(tmp_path):
    steps = tmp_path / "steps.log"
    started = time.time()
    proc = subprocess.Popen([*sh.command("--nproc", "2", "--max-restarts", "2", "--run-id", "g", script=None),
                             "--script", str(sh.REPO_ROOT / "bench" / "goodput_worker.py"), str(tmp_path),
                             str(STEPS), str(STEP_S)],
                            cwd=tmp_path, env=sh.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # killed between the saves after steps 20 and 40: the steps after the first are redone
        assert sh.wait_for(lambda: steps.exists() and " 30 " in steps.read_text(), timeout=120)
        _rank1(proc.pid).send_signal(signal.SIGKILL)
        code, _, err = sh.finish(proc, timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    wall = time.time() - started
    assert code == 0, err[-3000:]
    summary = orjson.loads((tmp_path / "logs" / "g" / "summary.json").read_bytes())
    ours = summary["goodput"]
    assert summary["restarts"] == 1 and set(ours["badput_s"]) == set(CAUSES)
    assert ours["productive_s"] + sum(ours["badput_s"].values()) == pytest.approx(ours["wall_s"], abs=0.005)
    completions, saves = from_steps_log(steps)
    bench = kept(completions, wall, saves)
    assert bench.last_step == STEPS - 1 and bench.steps_redone >= 5
    assert ours["productive_s"] == pytest.approx(bench.productive_s, rel=0.05, abs=0.15)
    assert ours["wall_s"] == pytest.approx(bench.wall_s, rel=0.05, abs=0.5)  # the launcher's start and exit
    assert ours["badput_s"]["redone"] == pytest.approx(bench.redone_s, rel=0.25, abs=0.55)  # heartbeats: every 0.5 s
    assert ours["badput_s"]["restart"] > 0 and ours["badput_s"]["failure_detection"] >= 0
    # TensorBoard: a point at the restart and one at the end, the last one summary.json's
    points = charted(tmp_path / "logs" / "g" / "tensorboard" / "goodput", "goodput/ratio")
    assert len(points) == 2 and points[0].step < points[1].step <= STEPS
    assert points[-1].value == pytest.approx(ours["ratio"], abs=1e-6)


def charted(where, tag: str) -> list:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(where))
    events.Reload()
    return events.Scalars(tag)
