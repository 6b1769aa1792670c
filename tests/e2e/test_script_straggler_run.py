"""A straggler of your own DDP script moved out live: 3 CPU ranks of examples/live_ddp.py (a plain
DDP loop that hands gpuherd its model, optimizer and data position through gpuherd.live; run until
the test says where to stop: tests/e2e/dropin/live_until.py),
under `gpuherd run` with a warm spare; rank 2 slowed to a quarter of its speed from outside
(bench/slow_rank.py) is named from its compute per step (the session's `step` records), SIGKILLed
and replaced by the spare while the other ranks keep their processes; the run exits 0 and the
recovery carries the evidence (every rank's compute per step, the job's step at its pace), as for
the built-in trainer (tests/e2e/test_straggler_run.py, which also waits for the job's step measured
after the move: the same code for both, so this test, in a suite at its time budget, does not).

The move-out waits 5 s here (system.straggler_move_after_s; 30 s by default) so that the test
stays short, and the loop runs until the test writes the step to stop at, so the run lasts what
the test needs on a loaded host and still ends with exit 0."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from bench.slow_rank import SlowDown
from tests.e2e.helpers import records
from tests.e2e.test_script_live_recovery_run import Lines, _finish, _printed, _ranks
from tests.e2e.test_torchrun_dropin import _env, gpuherd_run
from tests.supervisor.helpers import wait_for

SCRIPT = Path(__file__).resolve().parent / "dropin" / "live_until.py"


@pytest.mark.slow
def test_a_slowed_rank_of_a_live_ddp_script_is_moved_out_to_the_warm_spare(tmp_path):
    stop_file = tmp_path / "stop-at"
    proc = subprocess.Popen([*gpuherd_run(), "--nproc-per-node", "3", "--max-restarts", "1", "--run-id", "r",
                             "--no-report", "--set", "system.straggler_move_after_s=5", str(SCRIPT), str(stop_file),
                             "--steps", "1000000", "--dim", "128", "--batch", "16"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, errors = Lines(proc.stdout), Lines(proc.stderr)
    run_dir = tmp_path / "logs" / "r"
    slow = None
    try:
        said = lambda: "\n".join(line for _, line in errors.lines[-60:])  # noqa: E731 - what the run said so far
        assert wait_for(lambda: _printed(out, 10), timeout=240, interval=0.05), said()
        ranks = _ranks(proc.pid)
        slow = SlowDown(ranks[2], 4.0, measure=2.0).start()
        assert wait_for(lambda: records(run_dir, "recovery"), timeout=120, interval=0.2), "not moved out: " + said()
        slow.stop()
        moved = max(step for _, step, _ in out.steps())
        assert wait_for(lambda: _printed(out, moved + 5), timeout=120, interval=0.05), said()  # the group goes on
    finally:
        if slow is not None:
            slow.stop()
        stop_file.write_text(str(max((step for _, step, _ in out.steps()), default=0) + 10))
        code = _finish(proc)
        out.join()
        errors.join()
    err = "\n".join(line for _, line in errors.lines)
    assert code == 0, err[-3000:]

    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1  # nobody restarted
    (rec,) = summary["recoveries"]
    assert rec["kind"] == "straggler" and rec["outcome"] == "recovered" and rec["action"] == "replaced"
    assert rec["rank"] == 2 and rec["lost_pid"] == ranks[2] and rec["checkpoint_reads"] == 0
    assert {w["rank"]: w["pid"] for w in summary["workers"] if w["rank"] != 2} == {0: ranks[0], 1: ranks[1]}
    ev = rec["straggler"]
    assert ev["slowdown"] > 2.0 and ev["held_s"] >= 5.0 and set(ev["compute_ms_before"]) == {"0", "1", "2"}
    assert "straggler: rank 2 computed" in err
    assert "moved out live: SIGKILL to CPU2 (rank 2), a warm spare takes its rank" in err
    (suspect,) = summary["suspect_devices"]
    assert suspect["cause"] == "straggler" and suspect["rank"] == 2
    assert summary["goodput"]["badput_s"]["straggler"] > 0

    printed = out.steps()
    seen: dict[int, str] = {}
    for _, step, loss in printed:  # the step in flight is done again, with the same loss
        assert seen.setdefault(step, loss) == loss, f"step {step} printed {seen[step]} then {loss}"
    assert sorted(seen) == list(range(len(seen)))
