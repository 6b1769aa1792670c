"""bench/bench_recovery_cases.py's figure from one run's records: the next completed step after a
kill is the rebuilt group's first after a live recovery, the lost rank's replacement's after a
restart, and never a survivor's step that was in flight at the kill."""

from __future__ import annotations

from bench.bench_recovery_cases import _first_step


def _step(rank: int, step: int, time: float) -> dict:
    return {"type": "step", "rank": rank, "step": step, "time": time, "loss": 1.0}


def test_after_a_live_recovery_the_figure_is_the_rebuilt_groups_first_step():
    records = [_step(0, 24, 9.0), _step(1, 24, 9.0), _step(0, 25, 10.2),  # rank 0's step in flight at the kill
               {"type": "live", "event": "rejoined", "rank": 0, "time": 10.5},
               {"type": "live", "event": "rejoined", "rank": 1, "time": 10.6},
               _step(1, 25, 10.9), _step(0, 25, 10.95)]
    seconds, redone = _first_step(records, killed=10.0, lost_rank=1)
    assert round(seconds, 6) == 0.9 and redone == 0  # step 25 was not complete at the kill


def test_after_a_restart_the_figure_is_the_lost_ranks_first_step_again():
    records = [_step(0, 24, 9.0), _step(1, 24, 9.0), _step(0, 25, 10.2), _step(0, 20, 30.0), _step(1, 20, 30.1)]
    seconds, redone = _first_step(records, killed=10.0, lost_rank=1)
    assert round(seconds, 6) == 20.1 and redone == 5  # 20 to 24 again, from the checkpoint of step 20


def test_a_run_with_no_step_after_the_kill_has_no_figure():
    assert _first_step([_step(0, 24, 9.0), _step(1, 24, 9.0)], killed=10.0, lost_rank=1) is None
