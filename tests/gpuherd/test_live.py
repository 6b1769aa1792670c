"""gpuherd.live, a script's door to live recovery, in one process: what it does outside gpuherd
(nothing), what a mark holds and puts back, and the all-reduce that keeps a lost peer's error.
The recovery itself, through real processes: tests/e2e/test_script_live_recovery_run.py."""

from __future__ import annotations

import random

import pytest
import torch

import gpuherd.live as live
from gpuherd.live import ddp as live_ddp
from gpuherd.live.pace import StepPace
from gpuherd.live import position as pos


def test_outside_gpuherd_attach_touches_nothing_and_steps_are_the_range(monkeypatch):
    monkeypatch.delenv("GPUHERD_LIVE_RECOVERY", raising=False)
    model, optimizer = object(), object()  # not even a model: nothing of it is read
    session = live.attach(model, optimizer, position={"data": torch.Generator()})
    assert list(session.steps(range(3, 7))) == [3, 4, 5, 6] and session.step == 6


def test_a_mark_puts_the_position_and_the_rngs_back_in_place():
    class Sampler:
        def __init__(self) -> None:
            self.index = 0

        def state_dict(self) -> dict:
            return {"index": self.index}

        def load_state_dict(self, state: dict) -> None:
            self.index = state["index"]

    gen, sampler = torch.Generator().manual_seed(1), Sampler()
    position = {"data": gen, "sampler": sampler, "tokens": 10}
    mark = pos.capture(position, torch.device("cpu"))
    expected = (torch.rand(3, generator=gen), torch.rand(2), random.random())
    sampler.index, position["tokens"] = 7, 99
    pos.restore(position, mark, torch.device("cpu"))
    assert position["data"] is gen and position["sampler"] is sampler  # the script's own objects, rewound
    assert sampler.index == 0 and position["tokens"] == 10
    assert torch.equal(torch.rand(3, generator=gen), expected[0]) and torch.equal(torch.rand(2), expected[1])
    assert random.random() == expected[2]


def test_a_newcomer_keeps_its_own_state_of_an_rng_the_ranks_did_not_share():
    """Python's RNG differs between processes that never seed it: a newcomer takes the source's
    torch RNG and position, never its Python RNG (it was not the same on every rank)."""
    cpu = torch.device("cpu")
    random.seed(1)
    torch.manual_seed(1)
    source = pos.capture(None, cpu)
    random.seed(2)
    torch.manual_seed(2)
    own_python = random.getstate()
    pos.restore(None, source, cpu, shared={"position", "torch"})
    assert random.getstate() == own_python
    assert torch.equal(torch.get_rng_state(), source["rng"]["torch"])


def test_fingerprints_tell_which_parts_of_a_mark_differ():
    cpu = torch.device("cpu")
    torch.manual_seed(5)
    a = pos.fingerprints(pos.capture({"step": 1}, cpu))
    torch.manual_seed(5)
    b = pos.fingerprints(pos.capture({"step": 1}, cpu))
    torch.manual_seed(6)
    c = pos.fingerprints(pos.capture({"step": 2}, cpu))
    assert a == b
    assert a["torch"] != c["torch"] and a["position"] != c["position"] and a["python"] == c["python"]


def test_the_all_reduce_keeps_a_lost_peers_error_once_and_raises_any_other():
    lost: list[str] = []
    reduce = live_ddp.SafeReduce(lost.append)
    reduce._failed(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234"))
    reduce._failed(RuntimeError("Connection reset by peer"))
    assert reduce.broken.startswith("[pair.cc:553] Connection closed by peer") and len(lost) == 1
    with pytest.raises(ValueError, match="a bug of the script's"):
        reduce._failed(ValueError("a bug of the script's"))
    reduce.keep = False  # a rank that cannot be recovered live (the ranks' positions differ): as without gpuherd
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        reduce._failed(RuntimeError("Connection reset by peer"))


def test_the_optimizer_step_is_skipped_while_the_group_is_broken():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    reduce = live_ddp.SafeReduce(lambda _: None)
    live_ddp.skip_when_broken(optimizer, reduce)
    weight.grad = torch.ones(2)
    reduce.broken = "Connection closed by peer"
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(2))
    reduce.broken = None
    optimizer.step()
    assert torch.equal(weight.detach(), torch.zeros(2))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step(pace: StepPace, clock: Clock, start: float, ready: float | None, reduced: float | None, end: float,
          counted: bool = True) -> None:
    """One step as the session and its all-reduce hook tell it: begins, hands its last bucket over, the
    all-reduce completes, ends."""
    for at, call in ((start, pace.begin), (ready, pace.ready), (reduced, pace.reduced)):
        if at is not None:
            clock.now = at
            call()
    clock.now = end
    pace.end(counted)


def test_a_ranks_pace_is_its_step_minus_its_wait_for_the_others_in_the_gradient_all_reduce():
    clock = Clock()
    fast, slow = StepPace(clock), StepPace(clock)
    _step(fast, clock, 0.0, 0.1, 0.9, 1.0)  # its backward done at 0.1, the others' gradients at 0.9
    _step(slow, clock, 0.0, 0.9, 0.95, 1.0)  # the one the others waited for
    assert fast.take() == {"steps": 1, "compute_s": 0.2, "wait_s": 0.8}
    assert slow.take() == {"steps": 1, "compute_s": 0.95, "wait_s": 0.05}
    assert fast.take() == {}  # taken: nothing since


def test_a_step_of_a_broken_group_or_with_no_all_reduce_says_nothing_of_the_pace():
    clock = Clock()
    pace = StepPace(clock)
    _step(pace, clock, 0.0, 0.1, 0.2, 5.0, counted=False)  # a peer lost in it: its time is the recovery's
    _step(pace, clock, 5.0, None, None, 5.5)  # no bucket handed over (an eval step): its wait is unknown
    _step(pace, clock, 6.0, 6.2, 6.3, 6.5)
    _step(pace, clock, 7.0, 7.2, None, 7.5)  # the all-reduce's completion not seen: no wait
    assert pace.take() == {"steps": 2, "compute_s": 0.9, "wait_s": 0.1}
