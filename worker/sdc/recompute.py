"""Where nothing is replicated (FSDP: each rank holds its own shard), the step is recomputed
instead: at the interval, each rank keeps what its optimizer step was given (its parameter
shards, their gradients after clipping, its optimizer state), lets the step run, then restores
those and runs the update again. Bit-equal results: the step was computed right and its result
is still intact. Otherwise the first result was corrupted (in the update, or at rest right
after it); the recomputed state is kept (the heal), and the differing values and bits are named.

It covers the optimizer update and the state at rest after it, not the forward and backward
passes (a fault there gives wrong gradients that the recompute reproduces). Its cost is one
optimizer step and copies of the shard's state at the interval.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from worker.sdc.fingerprint import local
from worker.sdc.heal import locate


class StepRecompute:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, due: Callable[[], bool]) -> None:
        """`due()`: whether the optimizer step about to run is one to recompute."""
        self.model, self.optimizer, self.due = model, optimizer, due
        self._given: dict[str, Any] | None = None
        # registered before the fault injector's hooks: what the step was given, as it was given
        optimizer.register_step_pre_hook(self._keep)

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.model.named_parameters())

    def _state(self) -> dict[str, torch.Tensor]:
        return {f"{n}:{k}": local(v) for n, p in self._named() for k, v in self.optimizer.state.get(p, {}).items()
                if isinstance(v, torch.Tensor)}

    def _keep(self, *_: object) -> None:
        if self._given is not None or not self.due():
            return
        self._given = {
            "params": {n: local(p).detach().clone() for n, p in self._named()},
            "grads": {n: p.grad.detach().clone() for n, p in self._named() if p.grad is not None},
            "state": {k: v.detach().clone() for k, v in self._state().items()},
            # no state yet (the first step creates it): the recompute must start from none too
            "fresh": [n for n, p in self._named() if not self.optimizer.state.get(p)],
        }

    def verify(self) -> list[str]:
        """After a step that was due: recompute it; the values its first result got wrong
        (empty: none). The recomputed result stays in place either way."""
        given = self._given
        if given is None:  # the step was skipped (the NaN guard): nothing to recompute
            return []
        first = {n: local(p).detach().clone() for n, p in self._named()}
        first_state = {k: v.detach().clone() for k, v in self._state().items()}
        state = self._state()
        with torch.no_grad():
            for n, p in self._named():
                local(p).copy_(given["params"][n])
                p.grad = given["grads"].get(n)  # the engine dropped them after the step
            for k, v in given["state"].items():
                state[k].copy_(v)
            params = dict(self._named())
            for n in given["fresh"]:
                self.optimizer.state.pop(params[n], None)
        self.optimizer.step()  # with `_given` still set, the pre-hook keeps nothing of this step
        self.optimizer.zero_grad(set_to_none=True)
        self._given = None
        return locate(first, {n: local(p) for n, p in self._named()}) or locate(first_state, self._state())
