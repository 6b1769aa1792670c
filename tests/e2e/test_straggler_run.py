"""A straggler moved out live through the whole product: 4 CPU ranks of the built-in trainer
with a warm spare; rank 2 slowed to a quarter of its speed from outside (bench/slow_rank.py: a
SIGSTOP/SIGCONT cycle on its process) is named, SIGKILLed and replaced by the spare while the
other ranks keep their processes; the job exits 0, the recovery carries the evidence, the
device goes on the host's suspect list, and the goodput account books the time at its pace.

The move-out waits 5 s here (system.straggler_move_after_s; 30 s by default) so that the test
stays short; the rank's CPU rate is held at a quarter of what it was over the 3 s before (a
wall-time cycle slows it by less on a loaded host: the scheduler favours it while it runs). Steps per second
are counted from the `step` records (the test's own clock, from outside): the job must step
faster after the move-out than while the straggler set its pace. That bound is generous on
purpose (a shared host's noise); bench/bench_straggler_move.py measures the rates themselves."""

from __future__ import annotations

import subprocess
import sys
import time

import orjson
import pytest

from bench.slow_rank import SlowDown
from tests.e2e.helpers import records
from tests.e2e.test_live_recovery_run import TINY
from tests.supervisor.helpers import finish, wait_for

# Long enough that the job still runs ~15 s after the move-out at the fastest pace seen (35 steps/s
# after it, the move near step 150): the evidence's `after` is the second 5 s window closed after the
# move, and a job that ended first has none (a quiet machine ended 400 steps 7 s after the move).
STEPS = 700
SETTINGS = [*TINY, f"training.max_steps={STEPS}", "system.straggler_move_after_s=5"]  # a later --set wins


def _command(run_id: str) -> list[str]:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", "--nproc", "4",
           "--run-id", run_id, "--max-restarts", "1", "--spares", "1"]
    for item in SETTINGS:
        cmd += ["--set", item]
    return cmd


def _steps(run_dir) -> list[tuple[float, int]]:
    """(wall time, step) of rank 0's step records."""
    return [(r["time"], r["step"]) for r in records(run_dir, "step") if r.get("rank") == 0]


def _rate(steps: list[tuple[float, int]], t0: float, t1: float) -> float:
    inside = [(t, s) for t, s in steps if t0 <= t <= t1]
    if len(inside) < 2:
        return 0.0
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


@pytest.mark.slow
def test_a_rank_slowed_from_outside_is_moved_out_live_to_the_warm_spare(tmp_path, python_env):
    proc = subprocess.Popen(_command("slow"), cwd=tmp_path, env=python_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "logs" / "slow"
    slow = None
    try:
        assert wait_for(lambda: any(s >= 10 for _, s in _steps(run_dir)), timeout=240, interval=0.05)
        pids = {r["rank"]: r["pid"] for r in records(run_dir, "ready")}
        slowed_at = time.time()
        slow = SlowDown(pids[2], 4.0, measure=3.0).start()
        assert wait_for(lambda: records(run_dir, "recovery"), timeout=120, interval=0.2), "not moved out"
        moved_at = time.time()
    finally:
        if slow is not None:
            slow.stop()
        code, _out, err = finish(proc, timeout=300)
    assert code == 0, err[-3000:]

    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1  # nobody restarted
    (rec,) = summary["recoveries"]
    assert rec["kind"] == "straggler" and rec["outcome"] == "recovered" and rec["action"] == "replaced"
    assert rec["rank"] == 2 and rec["lost_pid"] == pids[2] and rec["checkpoint_reads"] == 0
    survivors = {w["rank"]: w["pid"] for w in summary["workers"] if w["rank"] != 2}
    assert survivors == {r: pids[r] for r in (0, 1, 3)}  # the others kept their processes
    ev = rec["straggler"]
    assert ev["slowdown"] > 2.0 and ev["held_s"] >= 5.0 and set(ev["compute_ms_before"]) == {"0", "1", "2", "3"}
    assert ev["step_s_after"] is not None and ev["step_s_after"] < ev["step_s_before"]
    assert "straggler: rank 2 computed" in err
    assert "moved out live: SIGKILL to CPU2 (rank 2), a warm spare takes its rank" in err
    assert "straggler rank 2 moved out" in err  # the summary's line

    (suspect,) = summary["suspect_devices"]
    assert suspect["cause"] == "straggler" and suspect["rank"] == 2 and "moved to a warm spare" in suspect["then"]
    # rank 2's stretch (on a loaded host another rank may be named for a while too: its own mark, not moved)
    (mark,) = [r for r in records(run_dir, "timeline") if r.get("event") == "straggler" and r.get("rank") == 2]
    assert mark["moved"] is True and mark["lost_s"] > 0
    assert summary["goodput"]["badput_s"]["straggler"] > 0

    steps = _steps(run_dir)
    during = _rate(steps, slowed_at + 1.0, moved_at)
    after = _rate(steps, moved_at + 2.0, steps[-1][0])
    assert after > during, f"steps/s while slowed {during:.2f}, after the move-out {after:.2f}"
