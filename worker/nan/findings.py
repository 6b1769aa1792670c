"""What the report says about one tensor: shape, first values, NaN/Inf counts.

Kept as plain data (dataclasses of builtins) so that the live guard and
`python -m worker.nan.report FILE.pkl` render the very same banner, and so the
pickle stays loadable without torch or this package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FIRST_VALUES = 5  # the report shows five values then '...'


@dataclass
class TensorFinding:
    name: str
    shape: list[int]  # the full (global) shape, as the model declares it
    numel: int  # elements inspected (this rank's shard under FSDP)
    nan: int
    inf: int
    first_values: list[float] = field(default_factory=list)
    local_shape: list[int] | None = None  # set when only a shard was inspected

    @property
    def non_finite(self) -> bool:
        return self.nan > 0 or self.inf > 0


def format_value(value: float) -> str:
    """Non-finite values as 'NaN', 'Inf' or '-Inf', finite ones short, so a
    half-broken tensor reads at a glance."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Inf" if value > 0 else "-Inf"
    return f"{value:.6g}"


def format_values(values: list[float], numel: int) -> str:
    """`['NaN', 'NaN', 'NaN', 'NaN', 'NaN', ...]` the report's documented form."""
    shown = ", ".join(repr(format_value(v)) for v in values)
    if numel > len(values):
        shown = f"{shown}, ..." if shown else "..."
    return f"[{shown}]"


def format_shape(shape: list[int] | tuple[int, ...]) -> str:
    """`torch.Size([4096, 4096])`, spelled out so the report needs no torch."""
    return f"torch.Size({list(shape)})"


def finding_from_array(name: str, array: np.ndarray, shape: list[int] | None = None) -> TensorFinding:
    """The report CLI's fallback for a dump written without findings."""
    flat = np.asarray(array, dtype=np.float32).reshape(-1)
    return TensorFinding(
        name=name,
        shape=list(shape) if shape is not None else list(np.shape(array)),
        numel=int(flat.size),
        nan=int(np.isnan(flat).sum()),
        inf=int(np.isinf(flat).sum()),
        first_values=[float(v) for v in flat[:FIRST_VALUES]],
    )


def finding_to_dict(finding: TensorFinding) -> dict[str, Any]:
    return {
        "name": finding.name, "shape": list(finding.shape), "numel": finding.numel,
        "nan": finding.nan, "inf": finding.inf, "first_values": list(finding.first_values),
        "local_shape": finding.local_shape,
    }


def finding_from_dict(raw: dict[str, Any]) -> TensorFinding:
    return TensorFinding(
        name=str(raw["name"]), shape=list(raw["shape"]), numel=int(raw["numel"]),
        nan=int(raw["nan"]), inf=int(raw["inf"]),
        first_values=[float(v) for v in raw.get("first_values", [])],
        local_shape=raw.get("local_shape"),
    )


# ---- ranks: who saw what
# Who saw what: one record per rank, gathered only after a bad step.
#
# Plain data without torch, so `python -m worker.nan.report` can rebuild it from
# the dump file alone.
@dataclass
class RankRecord:
    rank: int
    tag: str  # GPU6 / CPU1
    bracket: str  # [GPU 6]
    host: str
    device: str  # cuda:0 (GPU 6) / cpu
    loss: float
    grad_norm: float
    loss_bad: bool
    grad_norm_bad: bool
    bad_parameters: int  # parameters (this rank's values/shards) holding NaN/Inf
    bad_gradients: int  # parameters whose gradient (after reduction) holds NaN/Inf
    first_bad_module: str | None  # debug hooks: first module with a non-finite output
    first_bad_gradient: str | None  # debug hooks: first non-finite LOCAL gradient
    sharded: bool

    @property
    def evidence(self) -> bool:
        """This rank produced a non-finite value itself (rather than receiving
        one through the gradient all-reduce)."""
        return bool(self.loss_bad or self.bad_parameters or self.first_bad_module or self.first_bad_gradient)

    @property
    def flagged(self) -> bool:
        return bool(self.evidence or self.grad_norm_bad or self.bad_gradients)

    def describe(self) -> str:
        what = []
        if self.loss_bad:
            what.append(f"loss {self.loss}")
        if self.bad_parameters:
            what.append(f"{self.bad_parameters} non-finite parameters")
        if self.first_bad_module:
            what.append(f"first bad module {self.first_bad_module}")
        if self.first_bad_gradient:
            what.append(f"first bad local gradient {self.first_bad_gradient}")
        if self.grad_norm_bad and not what:
            what.append(f"grad norm {self.grad_norm}")
        if not what:
            what.append("finite")
        return f"rank {self.rank} {self.bracket} {self.device} on {self.host}: " + ", ".join(what)
