"""Putting a corrupted replica right without restarting a process.

- `take_from(source)`: the source (a rank of the healthy majority) broadcasts model, optimizer
  and grad-scaler state (gpuherd/state_broadcast.py, the live-recovery hand-over); the
  corrupted ranks load it, the others drop it. Data position and RNG stay each rank's own:
  a corrupted value does not touch them. The received bits are the healthy step's result,
  so the corrupted rank's step counts as redone with the healthy one's numbers.
- `Kept`: a verified state kept in host memory (two replicas, where no majority can decide):
  model, optimizer, scaler, data position, RNG and the loop's counters, taken where the
  replicas' parameters and optimizer state last agreed. Rolling back to it and recomputing the
  steps since is both the heal and the evidence (blame.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpuherd import rng
from gpuherd.state_broadcast import broadcast_state

if TYPE_CHECKING:
    from worker.engines import Engine
    from worker.sdc.parts import Loop


def _host_copy(obj: Any) -> Any:
    return copy.deepcopy(obj) if not isinstance(obj, torch.Tensor) else obj.detach().to("cpu", copy=True)


def host_copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return _host_copy(obj)


def engine_state(engine: Engine) -> dict[str, Any]:
    return {"model": engine.inner.state_dict(), "optimizer": engine.optimizer.state_dict(),
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None}


def load_engine_state(engine: Engine, state: dict[str, Any]) -> None:
    engine.inner.load_state_dict(state["model"])
    engine.optimizer.load_state_dict(state["optimizer"])
    if engine.scaler is not None and state["scaler"] is not None:
        engine.scaler.load_state_dict(state["scaler"])
    engine.optimizer.zero_grad(set_to_none=True)


def take_from(engine: Engine, source: int, rank: int, corrupted: bool, device: torch.device) -> dict[str, Any] | None:
    """A collective: every rank calls. Returns what the source sent to a corrupted rank (before
    it loaded it, to locate the damage), None elsewhere."""
    state = broadcast_state(engine_state(engine) if rank == source else None, source, device)
    if not corrupted:
        return None
    load_engine_state(engine, state)
    return state


def locate(mine: dict[str, torch.Tensor], healthy: dict[str, torch.Tensor], limit: int = 3) -> list[str]:
    """Each value of `mine` whose bits differ from `healthy`'s: name[index]: bit, old -> new."""
    found: list[str] = []
    for name, t in mine.items():
        h = healthy.get(name)
        if not isinstance(t, torch.Tensor) or not isinstance(h, torch.Tensor) or t.shape != h.shape:
            continue
        a, b = t.detach().cpu().reshape(-1), h.detach().cpu().reshape(-1)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        xor = a.view(ints) ^ b.view(ints)
        for index in xor.nonzero().flatten()[:limit].tolist():
            bits = int(xor[index]) & ((1 << (8 * a.element_size())) - 1)
            which = f"bit {bits.bit_length() - 1}" if bits & (bits - 1) == 0 else f"bits {bits:#x}"
            found.append(f"{name}[{index}] {which}: {float(a[index]):.6g} (healthy {float(b[index]):.6g})")
            if len(found) >= limit:
                return found
    return found


def named_optimizer_state(engine: Engine, state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An optimizer state dict's tensors under `param:key` names (state dicts key them by index)."""
    names = {id(p): n for n, p in engine.inner.named_parameters()}
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    order = [names.get(id(p), str(i)) for i, p in enumerate(params)]
    return {f"{order[i]}:{key}": v for i, entry in state["state"].items() for key, v in entry.items()
            if isinstance(v, torch.Tensor) and i < len(order)}


@dataclass
class Kept:
    step: int  # completed steps when it was taken
    engine: dict[str, Any]
    sampler: dict[str, Any]
    rng: dict[str, Any]
    counters: dict[str, Any]

    @classmethod
    def take(cls, engine: Engine, loop: Loop, device: torch.device, completed: int) -> Kept:
        return cls(completed, host_copy(engine_state(engine)), copy.deepcopy(loop.data_position()),
                   rng.capture(device), dict(loop.counters(), step=completed, owed=[]))

    def restore(self, engine: Engine, loop: Loop, device: torch.device) -> None:
        """The engine and the loop back at this state; the copy is kept (a second rollback reuses it)."""
        state = host_copy(self.engine)  # the optimizer adopts the tensors it is given
        load_engine_state(engine, state)
        loop.rewind_data(copy.deepcopy(self.sampler))
        rng.restore(self.rng, device)
        loop.load_counters(dict(self.counters))
