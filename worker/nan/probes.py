"""Debug-mode probes: the first module whose output goes non-finite (forward
hooks) and the first parameter whose LOCAL gradient goes non-finite (tensor
hooks, i.e. before DDP all-reduces it and spreads one rank's NaN everywhere).

Cheap on the hot path: a forward hook computes one finiteness flag per module
call and reads it on the host (debug mode only; statistics are computed only for
a bad call); gradient hooks only issue device ops. "The first bad call so far" is
kept in a few device buffers via `torch.where`, in O(1) memory, and read only
after a step was found bad.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from worker.nan.names import is_dtensor, local_tensor, named_modules, named_parameters

STAT_FIELDS = ("numel", "nan", "inf", "min", "max", "mean", "std", "absmax")


def tensor_stats(tensor: torch.Tensor) -> torch.Tensor:
    """[numel, nan, inf, min, max, mean, std, absmax] on device; moments over the
    finite entries only, so the statistics of a half-broken input stay readable."""
    x = tensor.detach().reshape(-1).float()
    finite = torch.isfinite(x)
    count = finite.sum()
    safe = torch.where(finite, x, torch.zeros_like(x))
    mean = safe.sum() / count.clamp(min=1)
    var = (torch.where(finite, x - mean, torch.zeros_like(x)) ** 2).sum() / count.clamp(min=1)
    # torch.full, not torch.tensor(python float): a fill kernel, no host->device copy
    inf = torch.full((), float("inf"), device=x.device)
    return torch.stack([
        torch.full((), float(x.numel()), device=x.device),
        torch.isnan(x).sum().float(),
        torch.isinf(x).sum().float(),
        torch.where(finite, x, inf).min() if x.numel() else inf * 0,
        torch.where(finite, x, -inf).max() if x.numel() else inf * 0,
        mean,
        var.sqrt(),
        safe.abs().max() if x.numel() else inf * 0,
    ])


def stats_dict(values: list[float]) -> dict[str, float]:
    return dict(zip(STAT_FIELDS, values, strict=True))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a module's output (tuples, lists, dicts, dataclass-free)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class MicroBatchCounter:
    """Which micro-batch of the step a forward/backward belongs to: a forward
    pre-hook on the root model counts the training forwards of this step."""

    def __init__(self) -> None:
        self.index = -1

    def reset(self) -> None:
        self.index = -1


class _FirstBad:
    """Device buffers remembering the first bad event of a step."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.event: torch.Tensor | None = None  # index of the first bad event, -1 = none
        self.micro: torch.Tensor | None = None
        self.payload: torch.Tensor | None = None
        self.count: torch.Tensor | None = None  # bad events this step

    def record(self, bad: torch.Tensor, event: int, micro: int, payload: torch.Tensor | None) -> None:
        device = bad.device
        if self.event is None or self.event.device != device:
            self.event = torch.full((), -1, dtype=torch.long, device=device)
            self.micro = torch.full((), -1, dtype=torch.long, device=device)
            self.payload = torch.zeros(self.width, device=device)
            self.count = torch.zeros((), dtype=torch.long, device=device)
        take = bad & (self.event < 0)
        self.event = torch.where(take, event, self.event)
        self.micro = torch.where(take, micro, self.micro)
        if payload is not None:
            self.payload = torch.where(take, payload.to(device), self.payload)
        self.count = self.count + bad.long()

    def read(self) -> tuple[int, int, list[float], int] | None:
        """(event, micro-batch, payload, count) or None; syncs (bad path only)."""
        if self.event is None:
            return None
        packed = torch.cat([torch.stack([self.event, self.micro, self.count]).double(),
                            self.payload.double()]).cpu().tolist()
        event, micro, count = int(packed[0]), int(packed[1]), int(packed[2])
        return None if event < 0 else (event, micro, packed[3:], count)

    def reset(self) -> None:
        self.event = self.micro = self.payload = self.count = None


class ForwardProbe:
    """Forward hooks on every module: names the first module (in execution
    order; hooks fire at module end, so the innermost culprit comes first)
    whose output holds a NaN/Inf, with the statistics of its input."""

    def __init__(self, model: torch.nn.Module, counter: MicroBatchCounter) -> None:
        self._model = model
        self._counter = counter
        self._handles: list[Any] = []
        self._calls: list[tuple[str, int]] = []  # (module name, micro-batch) per recorded call
        self._first = _FirstBad(2 * len(STAT_FIELDS))

    def attach(self) -> None:
        self._handles.append(self._model.register_forward_pre_hook(self._on_root_forward))
        for name, module in named_modules(self._model):
            hook = functools.partial(self._on_output, name)
            # With torch.compile a hook with Python side effects cannot be traced
            # correctly (the call counter would be baked in); run it eagerly.
            hook = torch.compiler.disable(hook)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _recording(self) -> bool:
        # Only training forwards: eval passes (model.eval(), no_grad) must not
        # leave a stale "bad module" for the next optimizer step.
        return self._model.training and torch.is_grad_enabled()

    def _on_root_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._recording():
            self._counter.index += 1

    def _on_output(self, name: str, module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._recording():
            return
        outs = [t for t in _tensors(output) if t.is_floating_point()]
        if not outs:
            return
        bad = torch.stack([~torch.isfinite(t).all() for t in outs]).any()
        # Statistics of input and output are ~15 passes over each activation (the
        # logits alone are B*T*vocab): paying that on every call made a debug step
        # 5x slower. One host read of the flag per module call (debug mode only)
        # buys computing them on the bad path alone.
        if bool(bad):
            ins = list(_tensors(args)) + list(_tensors(kwargs))
            worst = outs[0] if len(outs) == 1 else max(outs, key=lambda t: t.numel())
            in_stats = tensor_stats(ins[0]) if ins else torch.full((len(STAT_FIELDS),), float("nan"), device=bad.device)
            payload = torch.cat([in_stats.to(bad.device), tensor_stats(worst)])
            self._first.record(bad, len(self._calls), self._counter.index, payload)
        self._calls.append((name, self._counter.index))

    def first_bad(self) -> dict[str, Any] | None:
        found = self._first.read()
        if found is None:
            return None
        event, micro, payload, count = found
        width = len(STAT_FIELDS)
        return {
            "module": self._calls[event][0],
            "micro_batch": micro,
            "input": stats_dict(payload[:width]),
            "output": stats_dict(payload[width:]),
            "bad_outputs": count,  # module calls with a non-finite output this step
        }

    def reset(self) -> None:
        self._calls.clear()
        self._first.reset()


class GradProbe:
    """The first LOCAL gradient (this rank's, before any all-reduce or
    reduce-scatter spreads one rank's NaN everywhere) that goes non-finite.

    Replicated parameters (single process, DDP): a tensor hook on each
    parameter sees its local gradient -> names the parameter. Sharded
    parameters (FSDP2 DTensors) receive their gradient only after the
    reduce-scatter, so there a full backward hook on each leaf module checks
    the gradient w.r.t. the module's input -> names the module."""

    def __init__(self, model: torch.nn.Module, counter: MicroBatchCounter) -> None:
        self._model = model
        self._counter = counter
        self._handles: list[Any] = []
        self._names: list[tuple[str, str]] = []  # (kind, name) per hook index
        self._first = _FirstBad(0)

    def attach(self) -> None:
        sharded = False
        for name, param in named_parameters(self._model):
            if not param.requires_grad:
                continue
            if is_dtensor(param):
                sharded = True
                continue
            hook = functools.partial(self._on_grad, len(self._names))
            self._names.append(("parameter", name))
            self._handles.append(param.register_hook(torch.compiler.disable(hook)))
        if sharded:
            for name, module in named_modules(self._model):
                # Embeddings take integer ids: there is no input gradient to check.
                leaf = next(module.children(), None) is None and not isinstance(module, torch.nn.Embedding)
                if leaf and any(p.requires_grad for p in module.parameters()):
                    hook = functools.partial(self._on_module_grad, len(self._names))
                    self._names.append(("module", name))
                    self._handles.append(module.register_full_backward_hook(torch.compiler.disable(hook)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._names.clear()

    def _on_grad(self, index: int, grad: torch.Tensor) -> None:
        self._first.record(~torch.isfinite(grad).all(), index, self._counter.index, None)

    def _on_module_grad(self, index: int, module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        grads = [g for g in _tensors(grad_input) if g is not None and g.is_floating_point()]
        if grads:
            bad = torch.stack([~torch.isfinite(local_tensor(g)).all() for g in grads]).any()
            self._first.record(bad, index, self._counter.index, None)

    def first_bad(self) -> dict[str, Any] | None:
        found = self._first.read()
        if found is None:
            return None
        event, micro, _, count = found
        kind, name = self._names[event]
        return {kind: name, "micro_batch": micro, "bad_gradients": count}

    def reset(self) -> None:
        self._first.reset()
