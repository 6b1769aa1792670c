"""A sharded background write that the lost peer broke is written again by the rebuilt group,
whichever of the rank's calls met its failure first: live recovery asks the saver (`cut_short`)
after the loop's own step-boundary `poll` may already have raised the failure (the write's last
barrier, on the dead peer, failed before the loop's next collective did); and a write that reaches
its collectives only after the group is gone fails instead of writing alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.checkpoint_writer import BackgroundWrite, Written
from worker import distributed as wdist
from worker.saver import Saver

def _saver_with(write: BackgroundWrite) -> Saver:
    saver = Saver.__new__(Saver)  # only the fields cut_short and poll read: no checkpointer, no group to build
    saver.inflight, saver._raised, saver.group = write, None, object()
    saver.exit_wait_s, saver.bracket = 5.0, "[rank 0]"
    return saver

def _write(step: int, error: BaseException | None) -> BackgroundWrite:
    def run() -> Written:
        if error is not None:
            raise error
        return Written(Path(f"step_{step}"), 0.0)
    write = BackgroundWrite(step, Path(f"step_{step}"), run, lambda done: None)
    assert write.wait(5)
    return write

def test_a_failed_write_the_loop_already_raised_is_still_reported_cut_short():
    lost = RuntimeError("[gloo] Connection closed by peer")
    saver = _saver_with(_write(10, lost))
    with pytest.raises(RuntimeError, match="closed by peer"):
        saver.poll()  # the loop met the failure first
    assert saver.inflight is None
    assert saver.cut_short() == 10  # before: None, and the rebuilt group never wrote step 10's save
    assert saver.cut_short() is None  # said once

def test_a_failed_write_still_in_flight_is_reported_and_a_finished_one_is_not():
    assert _saver_with(_write(5, RuntimeError("[gloo] Connection closed by peer"))).cut_short() == 5
    assert _saver_with(_write(5, None)).cut_short() is None

def test_a_write_collected_without_error_leaves_nothing_to_report():
    saver = _saver_with(_write(15, None))
    saver.poll()
    assert saver.cut_short() is None

def test_a_collective_over_a_group_that_is_gone_fails_instead_of_going_on_alone():
    """A writer thread that reaches its collectives after live recovery left the broken group (every
    group destroyed) must fail: going on as one process published a checkpoint of its own shards."""

    assert not wdist.active()
    assert wdist.gather_objects("x") == ["x"]  # a single process with no group at all: itself
    wdist.barrier()
    with pytest.raises(RuntimeError, match="process group is gone"):
        wdist.gather_objects("x", group=object())
    with pytest.raises(RuntimeError, match="process group is gone"):
        wdist.barrier(group=object())
