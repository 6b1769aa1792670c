"""The torchft side of bench/bench_live_recovery_torchft.py (recovery): from both replica groups'
step records and the time of the kill, the survivor's next step, the full batch's return and the
steps the survivor took alone, on made-up records."""

from __future__ import annotations

import pytest

from bench.bench_live_recovery_torchft import TorchftRecovery, recovery


def _step(group: int, start: float, participants: int = 2, attempt: int = 0, committed: bool = True,
          participating: bool = True) -> dict:
    return {"type": "step", "group": group, "attempt": attempt, "start": start, "time": start + 0.1,
            "committed": committed, "participants": participants, "participating": participating}


def test_the_survivor_goes_on_alone_until_the_restarted_group_contributes_again():
    # killed at t=10.05: group 0's step started at 10.0 fails, its next two are taken alone,
    # group 1's new worker heals at 13 (not participating) and contributes from 14
    steps = [_step(0, t) for t in (9.0, 9.5)] + [_step(0, 10.0, committed=False)]
    steps += [_step(0, 12.0, participants=1), _step(0, 13.0, participants=1), _step(0, 14.0)]
    steps += [_step(1, 9.0), _step(1, 13.0, participants=1, attempt=1, participating=False),
              _step(1, 14.0, attempt=1)]
    got = recovery(steps, 10.05)
    assert got == TorchftRecovery(survivor=pytest.approx(2.05), full=pytest.approx(4.05), shrunk_steps=2, step_s=None)


def test_a_step_in_flight_at_the_kill_is_no_recovery():
    # group 0's step started before the kill was still committed with group 1's gradients
    steps = [_step(0, 10.0), _step(0, 12.0, participants=1), _step(1, 13.0, attempt=1)]
    got = recovery(steps, 10.05)
    assert got is not None and got.survivor == pytest.approx(2.05)


def test_a_restarted_group_that_never_contributed_again_gives_no_figures():
    steps = [_step(0, 12.0, participants=1), _step(1, 13.0, participants=1, attempt=1, participating=False),
             _step(1, 9.0)]  # the old worker's steps are no recovery either
    assert recovery(steps, 10.05) is None


def test_the_survivors_typical_step_leaves_out_its_first_two():
    steps = [_step(0, t) for t in (0.0, 3.0, 4.0, 5.0, 7.0)]
    steps += [_step(0, 12.0, participants=1), _step(1, 13.0, attempt=1)]
    got = recovery(steps, 10.05)
    assert got is not None and got.step_s == pytest.approx(1.5)  # the steps at 4.1, 5.1 and 7.1
