"""The pieces of an async save (worker/save_snapshot.py, worker/save_cost.py): the copy into
the shared buffer and the state the writer rebuilds from it, and the account of what a save
cost the loop on its step times."""

from __future__ import annotations

import io
import resource
from collections import OrderedDict

import pytest
import torch

from bench.save_loss import save_losses
from worker.save_cost import WARMUP_STEPS, Closed, LoopCost
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


def _steps(cost: LoopCost, clock: list[float], steps: int, seconds: float, write_ended: bool = True) -> list:
    closed = []
    for _ in range(steps):
        clock[0] += seconds
        closed.append(cost.step_ended(clock[0], write_ended))
    return [c for c in closed if c is not None]


def test_a_save_costs_its_window_less_the_steps_it_held_at_the_typical_step():
    cost, clock = LoopCost(), [0.0]
    _steps(cost, clock, WARMUP_STEPS + 1, 5.0)  # slow first steps: not the typical one
    _steps(cost, clock, 10, 1.0)
    assert cost.typical_step == 1.0
    cost.open(10, clock[0] + 0.2)  # the save starts 0.2 s after its step ended, and blocks 0.3 s
    clock[0] += 0.5
    assert _steps(cost, clock, 1, 1.0, write_ended=False) == []  # 0.5 s blocked, then a step: in flight
    [closed] = _steps(cost, clock, 1, 1.5)  # a step 0.5 s slower, at whose end the write is known to have ended
    assert closed == Closed(10, pytest.approx(0.3 + 0.5), 2)
    assert cost.typical_step == 1.0  # the steps the window held are nobody's typical step
    _steps(cost, clock, 11, 0.9)  # the step after the one that closed it is quiet again: 11 of 21 are 0.9 s
    assert cost.typical_step == pytest.approx(0.9)
    cost.open(12, clock[0] + 0.1)  # a blocking save: closed when it returns
    assert cost.close(clock[0] + 2.1) == Closed(12, pytest.approx(2.0), 0)
    assert cost.close(clock[0] + 3.0) is None  # nothing open


def test_a_save_before_any_quiet_step_costs_its_whole_window():
    cost, clock = LoopCost(), [0.0]
    _steps(cost, clock, WARMUP_STEPS + 1, 1.0)
    cost.open(3, clock[0])
    assert cost.typical_step is None
    assert _steps(cost, clock, 1, 1.0) == [Closed(3, pytest.approx(1.0), 1)]  # an upper bound: steps count as free


def test_a_write_still_in_flight_at_the_next_save_is_closed_there_and_the_wait_is_the_next_ones():
    cost, clock = LoopCost(), [0.0]
    _steps(cost, clock, WARMUP_STEPS + 5, 1.0)
    cost.open(7, clock[0])
    _steps(cost, clock, 3, 1.2, write_ended=False)
    assert cost.close(clock[0] + 0.1) == Closed(7, pytest.approx(3 * 0.2 + 0.1), 3)  # the next save begins
    cost.open(10, clock[0] + 0.1)
    assert _steps(cost, clock, 1, 1.6) == [Closed(10, pytest.approx(1.5 - 1.0), 1)]  # its wait included


def _replayed_run(saves: dict[int, tuple[str, float]], steps: int) -> list[dict]:
    """The records of a loop saving after the steps in `saves` (mode, seconds its write takes),
    with the trainer's `accounted` records from a LoopCost that saw the same moments, as
    worker/saver.py feeds it: steps 0.3 s slower while a write is in flight, 0.05 s from a
    step's end to its save, 0.1 s blocked by an async save, a save waiting for the write in
    flight, and a final blocking save."""
    cost, records, t, publish = LoopCost(), [], 0.0, None

    def record(type_: str, **fields) -> None:
        records.append({"type": type_, "rank": 0, "time": fields.pop("at", t), **fields})

    def account(closed: Closed | None) -> None:
        if closed is not None:
            record("checkpoint_write", state="accounted", step=closed.step, cost_s=closed.cost, steps=closed.steps)

    for k in range(steps + 1):
        if k < steps:
            t += (1.3 if publish is not None else 1.0) + 0.013 * (k % 4)
            record("step", step=k)
            ended = publish is None or publish <= t
            account(cost.step_ended(t, ended))
            publish = None if ended else publish
        done = k + 1 if k < steps else steps
        if done not in saves and k < steps:
            continue
        t += 0.05
        record("phase", name="checkpoint")
        account(cost.close(t))
        cost.open(done, t)
        t, publish = max(t, publish or t), None  # the write in flight ends first
        mode, write = saves.get(done, ("blocking", 0.4))
        if mode == "blocking":
            t += write
            record("checkpoint", step=done, mode="blocking")
            account(cost.close(t))
        else:
            t += 0.1
            publish = t + write
            record("checkpoint", step=done, mode="async", at=publish)
        record("phase", name="train")
        if k == steps:
            break
    return sorted(records, key=lambda r: r["time"])


def test_the_trainers_account_is_what_its_step_records_show():
    """bench/save_loss.py reads the windows and typical step off the records: the same numbers,
    whatever the case (a save before any quiet step, a write over several steps, one still in
    flight at the next save, a blocking one)."""
    saves = {2: ("async", 0.5), 8: ("async", 2.9), 14: ("async", 9.0), 20: ("blocking", 0.6), 26: ("async", 0.2)}
    records = _replayed_run(saves, 30)
    rows = save_losses(records)["saves"]
    assert [row["step"] for row in rows] == list(saves)
    for row in rows:
        assert row["trainer_s"] == pytest.approx(row["records_s"], abs=1e-9), row
    assert rows[0]["records_s"] == pytest.approx(0.1 + 1.3 + 0.026)  # before any quiet step: the whole window


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_expected_bytes_are_pinned_before_the_first_save():
    """Registering the pages backs and locks each one: done at the start, not in the first save."""
    taker = SnapshotTaker(torch.device("cuda", 0), 8 << 20, 4 << 20)
    try:
        assert taker.region.pinned == 4 << 20
        weight = torch.randn(1024, 1024, device="cuda")  # 4 MiB: more than was expected, pinned anew
        built = rebuild(taker.take({"w": weight, "b": torch.ones(3, device="cuda")}), taker.region.map)
        assert taker.region.pinned > 4 << 20
        assert torch.equal(built["w"], weight.cpu()) and torch.equal(built["b"], torch.ones(3))
    finally:
        taker.close()
