"""The goodput benchmark's per-fault cost (bench/goodput_accounting.py: fault_cost): from the
fault until training completed the second step past the one it had reached, less two steps,
on made-up step logs."""

from __future__ import annotations

from bench.goodput_accounting import Completion, fault_cost


def _steps(pid: int, start: int, stop: int, t0: float, step_s: float = 1.0) -> list[Completion]:
    return [Completion(t0 + i * step_s, pid, step, None if i == 0 else step_s)
            for i, step in enumerate(range(start, stop))]


def test_a_restart_costs_its_detection_restart_and_the_steps_trained_again():
    # steps 0..9 at t=0..9, killed at 9.5, the restart resumes from step 5 at t=20 (5..14 at 20..29)
    log = _steps(1, 0, 10, 0.0) + _steps(2, 5, 15, 20.0)
    # two steps past step 9 when step 11 completed at t=26: 26 - 9.5 - 2 (those steps' own seconds)
    assert fault_cost(log, 9.5) == 14.5


def test_a_step_the_dying_attempt_still_completed_is_not_getting_past_it():
    log = _steps(1, 0, 10, 0.0) + [Completion(9.6, 1, 10, 0.6)] + _steps(2, 5, 15, 20.0)
    assert fault_cost(log, 9.5) == 14.5  # steps 10 and 11 count where they were trained again (t=26)


def test_a_stop_and_continue_costs_its_pause_and_an_undisturbed_run_nothing():
    log = _steps(1, 0, 5, 0.0) + [Completion(7.5, 1, 5, 3.5)] + _steps(1, 6, 9, 8.5)
    assert fault_cost(log, 4.5) == 2.0
    assert fault_cost(_steps(1, 0, 10, 0.0), 4.5) == 0.0


def test_a_run_that_never_got_past_the_fault_has_no_cost():
    assert fault_cost(_steps(1, 0, 10, 0.0), 9.5) is None


def test_the_dying_attempts_last_step_is_not_getting_past_it_when_nothing_came_after():
    # rank 0 finished step 10 (rank 1 had joined its all-reduce) as rank 1 died; the restart hung
    # before step 10 came round again
    log = _steps(1, 0, 10, 0.0) + [Completion(9.6, 1, 10, 0.6)] + _steps(2, 5, 8, 20.0)
    assert fault_cost(log, 9.5) is None


def test_a_live_recovery_counts_the_stall_after_the_step_in_flight():
    # rank 1 killed at 9.5 after joining step 10's all-reduce: the same rank-0 process completes
    # step 10 at 9.6, then waits for the rebuilt group; step 11 comes at 13.6 instead of 10.6
    log = _steps(1, 0, 10, 0.0) + [Completion(9.6, 1, 10, 0.6)] + _steps(1, 11, 15, 13.6)
    assert abs(fault_cost(log, 9.5) - 2.1) < 1e-9  # 13.6 - 9.5 - 2
