"""Goodput's TensorBoard points: written with tensorboard's event-file writer alone (no torch),
read back as TensorBoard reads them; a missing package or a refusing disk costs the charts only."""

from __future__ import annotations

import pytest

from supervisor.goodput import CAUSES, Goodput
from supervisor.goodput.tensorboard import GoodputScalars, last_step, scalars
from supervisor.goodput.timeline import Event

pytest.importorskip("tensorboard")


def _goodput(ratio: float) -> Goodput:
    badput = {cause: 0.0 for cause in CAUSES}
    badput["restart"] = 100.0 * (1 - ratio)
    return Goodput(ratio, 100.0, 100.0 * ratio, badput)


def _ready(tmp_path) -> GoodputScalars:
    charts = GoodputScalars(tmp_path)
    charts.loading.join(timeout=60)
    return charts


def test_every_cause_is_a_tag_and_the_points_read_back_in_order(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    charts = _ready(tmp_path)
    assert charts.write(_goodput(0.5), step=10, wall_time=1000.0)
    assert charts.write(_goodput(0.75), step=30, wall_time=1060.0)
    charts.close()
    events = EventAccumulator(str(tmp_path / "tensorboard" / "goodput"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == set(scalars(_goodput(1.0))) and {f"goodput/badput_s/{c}" for c in CAUSES} <= tags
    ratio = events.Scalars("goodput/ratio")
    assert [(p.step, p.value, p.wall_time) for p in ratio] == [(10, 0.5, 1000.0), (30, 0.75, 1060.0)]
    assert events.Scalars("goodput/badput_s/restart")[-1].value == pytest.approx(25.0)


def test_the_step_axis_is_the_newest_completed_step():
    events = [Event(1.0, "step", 0, step=4), Event(2.0, "phase", 0, name="train"), Event(3.0, "step", 1, step=7),
              Event(4.0, "checkpoint", 0, step=9)]
    assert last_step(events) == 7 and last_step([]) == 0


def test_a_disk_that_refuses_costs_the_charts_once_never_the_run(tmp_path):
    (tmp_path / "tensorboard").write_text("a file where the directory should be")
    charts = _ready(tmp_path)
    assert not charts.write(_goodput(0.5), step=1)
    assert charts.failed and not charts.write(_goodput(0.5), step=2)
    charts.close()


def test_nothing_is_written_before_the_import_finished_or_without_tensorboard(tmp_path, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    charts = GoodputScalars(tmp_path)
    assert charts.loading is None and not charts.write(_goodput(0.5), step=1)
    assert not (tmp_path / "tensorboard").exists()
