"""Per-parameter NaN/Inf inspection of values and gradients (the bad path only).

Runs only after a non-finite step was agreed on, so it may read every tensor;
it still brings everything to the host in ONE transfer (counts and first
values of all tensors concatenated) instead of one sync per parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.nan.findings import FIRST_VALUES, TensorFinding
from worker.nan.names import is_dtensor, local_tensor, named_parameters


@dataclass
class ModelInspection:
    parameters: list[TensorFinding]  # every parameter, model order
    gradients: list[TensorFinding]  # every parameter that has a gradient
    sharded: bool  # True when some tensors are DTensor shards (FSDP2)

    @property
    def bad_parameters(self) -> list[TensorFinding]:
        return [f for f in self.parameters if f.non_finite]

    @property
    def bad_gradients(self) -> list[TensorFinding]:
        return [f for f in self.gradients if f.non_finite]

    @property
    def affected_layers(self) -> list[str]:
        """Names with a non-finite gradient or value, in model order."""
        bad = {f.name for f in self.bad_gradients} | {f.name for f in self.bad_parameters}
        return [f.name for f in self.parameters if f.name in bad]


def inspect_model(model: torch.nn.Module) -> ModelInspection:
    jobs: list[tuple[str, torch.Tensor, torch.Tensor, str]] = []  # name, full, local, kind
    sharded = False
    for name, param in named_parameters(model):
        sharded = sharded or is_dtensor(param)
        jobs.append((name, param, local_tensor(param.detach()), "param"))
        if param.grad is not None:
            jobs.append((name, param.grad, local_tensor(param.grad.detach()), "grad"))
    if not jobs:
        return ModelInspection([], [], sharded)
    pieces = []
    for _, _, local, _ in jobs:
        flat = local.reshape(-1)
        # Counts as float64 are exact up to 2**53 elements: plenty.
        pieces.append(torch.stack([torch.isnan(flat).sum(), torch.isinf(flat).sum()]).double())
        pieces.append(flat[:FIRST_VALUES].double())
    values = torch.cat([p.to(pieces[0].device) for p in pieces]).cpu().tolist()  # the one sync
    params: list[TensorFinding] = []
    grads: list[TensorFinding] = []
    at = 0
    for name, full, local, kind in jobs:
        shown = min(FIRST_VALUES, local.numel())
        nan, inf = int(values[at]), int(values[at + 1])
        first = values[at + 2: at + 2 + shown]
        at += 2 + shown
        finding = TensorFinding(
            name=name, shape=list(full.shape), numel=local.numel(), nan=nan, inf=inf,
            first_values=first,
            local_shape=list(local.shape) if is_dtensor(full) else None,
        )
        (params if kind == "param" else grads).append(finding)
    return ModelInspection(params, grads, sharded)
