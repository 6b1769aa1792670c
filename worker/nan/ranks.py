"""Who saw what: one record per rank, gathered only after a bad step.

Plain data without torch, so `python -m worker.nan.report` can rebuild it from
the dump file alone.
"""

from __future__ import annotations

from dataclasses import dataclass


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
