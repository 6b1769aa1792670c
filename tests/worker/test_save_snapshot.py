"""The pieces of an async save (worker/save_snapshot.py, worker/save_cost.py): the copy into
the shared buffer and the state the writer rebuilds from it, and the account of what a save
cost the loop on its step times."""

from __future__ import annotations

import io
import resource
from collections import OrderedDict

import pytest
import torch

from worker.save_cost import WARMUP_STEPS, LoopCost
from worker.direct_sink import ALIGN as DIRECT_ALIGN
from worker.save_snapshot import SnapshotTaker, TooLarge, rebuild


def test_the_writer_rebuilds_the_state_as_it_was_when_copied():
    model = torch.nn.Linear(4, 3)
    taker = SnapshotTaker(torch.device("cpu"), 1 << 20, 1 << 16)
    try:
        state = {"model": model.state_dict(), "tied": [model.weight, model.weight], "row": model.weight[0],
                 "groups": [{"lr": 0.1, "params": (0, 1)}], "step": 5, "empty": torch.empty(0, 3),
                 "half": torch.arange(6, dtype=torch.bfloat16).view(2, 3)}
        snapshot = taker.take(state)
        before = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)  # training goes on changing the live tensors
        state["groups"][0]["lr"] = 0.2  # and the param groups
        built = rebuild(snapshot, taker.region.map)
        assert isinstance(built["model"], OrderedDict) and built["model"]._metadata == model.state_dict()._metadata
        assert torch.equal(built["model"]["weight"], before) and torch.equal(built["row"], before[0])
        assert built["tied"][0] is built["tied"][1]  # one tensor, one slot: saved once, as torch.save would
        assert built["groups"] == [{"lr": 0.1, "params": (0, 1)}] and built["step"] == 5
        assert built["empty"].shape == (0, 3) and built["half"].dtype == torch.bfloat16
        assert torch.equal(built["half"], state["half"])
        # each tensor is backed by its own bytes: torch.save writes the slots, not the whole buffer
        out = io.BytesIO()
        torch.save(built, out)
        assert len(out.getvalue()) < 16 * 1024
        del built
    finally:
        taker.close()


def test_on_a_cpu_run_the_buffer_is_backed_before_the_first_save_so_its_copy_faults_no_page():
    """The first save costs the loop what the others do: its copy takes no page fault per page of
    a fresh buffer (the loop backed and mapped it when the saver started)."""
    state = {"w": torch.randn(4 << 20 >> 2), "v": torch.randn(1000)}  # 4 MB: 1024 pages
    taker = SnapshotTaker(torch.device("cpu"), 16 << 20, 8 << 20)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        snapshot = taker.take(state)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 100, faults
        assert snapshot.slots[0].offset % DIRECT_ALIGN == 0  # large tensors start block-aligned
    finally:
        taker.close()


def test_a_state_larger_than_the_buffer_is_refused_not_cut():
    taker = SnapshotTaker(torch.device("cpu"), 1024, 1024)
    try:
        with pytest.raises(TooLarge):
            taker.take({"big": torch.zeros(1024)})
    finally:
        taker.close()


def _ticks(cost: LoopCost, clock: list[float], steps: int, seconds: float) -> None:
    for _ in range(steps):
        clock[0] += seconds
        cost.tick(clock[0])


def test_a_save_costs_its_window_less_the_steps_it_held_at_the_typical_step():
    cost, clock = LoopCost(), [0.0]
    _ticks(cost, clock, WARMUP_STEPS + 1, 5.0)  # slow first steps: not the typical one
    _ticks(cost, clock, 10, 1.0)
    assert cost.typical_step == 1.0
    cost.open(10, clock[0] + 0.2)  # the save starts 0.2 s after the boundary: its step ended
    clock[0] += 0.5  # 0.3 s blocked, then the next boundary
    cost.tick(clock[0])
    _ticks(cost, clock, 2, 1.5)  # two steps 0.5 s slower while the write runs
    assert cost.close(clock[0], at_tick=True) == (10, pytest.approx(0.3 + 2 * 0.5), 2)
    assert cost.typical_step == 1.0  # the steps the write touched are nobody's typical step
    cost.open(12, clock[0] + 0.1)  # a blocking save: closed at the next boundary
    clock[0] += 2.1
    cost.tick(clock[0])
    assert cost.close(clock[0], at_tick=True) == (12, pytest.approx(2.0), 0)
    assert cost.close(clock[0], at_tick=True) is None  # nothing open
