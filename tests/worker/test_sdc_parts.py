"""The silent-data-corruption check built from its parts, without a trainer and without processes:
the rollback a two-replica mismatch does puts back every part it kept, and the check is due at
its interval and before every checkpoint, which one save schedule says."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from gpuherd.contract import WorkerIdentity
from gpuherd.liveness import Liveness
from gpuherd.status_channel import StatusWriter
from worker.save_schedule import SaveSchedule
from worker.sdc import Loop, SdcCheck, SdcSettings

CPU = torch.device("cpu")


@dataclass
class ToyLoop:
    """A training loop's counters and data position, as the trainer keeps them."""

    step: int = 0
    skipped_steps: int = 0
    position: dict[str, Any] = field(default_factory=lambda: {"index": 0, "epoch": 0})

    def counters(self) -> dict[str, Any]:
        return {"step": self.step, "saved_step": 0, "skipped_steps": self.skipped_steps, "owed": []}

    def load_counters(self, state: dict[str, Any]) -> None:
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]

    def parts(self) -> Loop:
        def rewind(sampler: dict[str, Any]) -> None:
            self.position = sampler
        return Loop(step=lambda: self.step, counters=self.counters, load_counters=self.load_counters,
                    data_position=lambda: dict(self.position), rewind_data=rewind, exclude_pause=lambda s: None)


def _check(loop: ToyLoop, engine: Any, **settings: Any) -> SdcCheck:
    s = {"every": 1, "optim_every": 10, "saves": SaveSchedule(every=0, max_steps=20), "strategy": "ddp", **settings}
    identity = WorkerIdentity(rank=0, local_rank=0, world_size=2, local_world_size=2, device_kind="cpu",
                              device_id=0, supervised=False)
    status = StatusWriter(None, 0)
    return SdcCheck(SdcSettings(**s), engine, identity, CPU, status, Liveness(status),
                    SimpleNamespace(ranks=[0, 1], generation=0), loop.parts())


def _engine() -> SimpleNamespace:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return SimpleNamespace(inner=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1), scaler=None)


def _step(engine: SimpleNamespace, loop: ToyLoop) -> None:
    engine.inner(torch.randn(3, 4)).pow(2).sum().backward()
    engine.optimizer.step()
    engine.optimizer.zero_grad(set_to_none=True)
    loop.step += 1
    loop.skipped_steps += 1
    loop.position = {"index": loop.position["index"] + 8, "epoch": 0}


def test_a_two_replica_check_rolls_the_engine_data_rng_and_counters_back_to_the_state_it_kept():
    engine, loop = _engine(), ToyLoop(step=5)
    _step(engine, loop)  # the optimizer has state: the kept copy must bring it back too
    check = _check(loop, engine)
    kept = check.kept
    assert kept is not None and kept.step == 6  # two replicas, no majority: a state to recompute from
    params = [p.detach().clone() for p in engine.inner.parameters()]
    moments = [s["exp_avg"].clone() for s in engine.optimizer.state.values()]
    draw = (random.random(), torch.rand(1))
    for _ in range(3):
        _step(engine, loop)
    assert loop.step == 9 and not torch.equal(params[0], engine.inner.weight)

    kept.restore(check.engine, check.loop, check.device)

    assert (loop.step, loop.skipped_steps, loop.position) == (6, 1, {"index": 8, "epoch": 0})
    assert all(torch.equal(a, b) for a, b in zip(params, engine.inner.parameters(), strict=True))
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, engine.optimizer.state.values(), strict=True))
    assert (random.random(), torch.rand(1)) == draw  # the steps after it draw the same numbers again


def test_a_check_is_due_at_its_interval_and_before_every_checkpoint_and_the_last_step():
    check = _check(ToyLoop(), _engine(), every=3, saves=SaveSchedule(every=4, max_steps=10))
    assert [done for done in range(1, 11) if check._due(done, check.every)] == [3, 4, 6, 8, 9, 10]
    assert not any(check._due(done, 0) for done in range(1, 11))  # 0: off, saves or not



def test_the_loop_and_the_check_read_one_save_schedule():
    """Periodic saves every 4 steps up to step 10; the final save after step 10 is not periodic,
    but its state is written all the same (the check compares the replicas before it)."""
    saves = SaveSchedule(every=4, max_steps=10)
    assert [d for d in range(1, 11) if saves.periodic_after(d)] == [4, 8]
    assert [d for d in range(1, 11) if saves.saved_after(d)] == [4, 8, 10]
    assert [d for d in range(1, 11) if SaveSchedule(every=0, max_steps=10).saved_after(d)] == [10]
