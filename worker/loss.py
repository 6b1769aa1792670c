"""The output projection and cross-entropy, fused and chunked over tokens.

The plain `F.cross_entropy(F.linear(h, W).float(), targets)` materialises the
whole [tokens, vocab] logits in bf16 and fp32 and keeps them for backward: for
GPT-2's 50k vocabulary and 16k tokens per micro-batch that is 3.3 GB per fp32 copy,
several at once at the peak. Here the logits exist one chunk of tokens at a time
(gpuherd.memory_plan.ce_chunk_tokens): each chunk's loss and its gradients (w.r.t.
the hidden states and the weight, softmax minus one-hot) are computed right away in
forward, so backward only hands out the stored gradients and no chunk is ever
recomputed; the bytes moved are a little below the plain path's (bench/worker_costs.py
counts both). This is the technique of Liger-Kernel's fused linear cross-entropy,
written with torch ops.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from gpuherd.memory_plan import ce_chunk_tokens


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on this device type now (None: autocast is off)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """mean(cross_entropy(hidden @ weight.T, targets)) in fp32, without full logits.

    hidden [N, D], weight [V, D], targets [N]. The matmuls run in autocast's dtype
    when autocast is on (as `F.linear` would), else in hidden's; softmax and the
    loss are always fp32.
    """
    chunk = chunk or ce_chunk_tokens(*weight.shape)
    dtype = autocast_dtype(hidden.device.type)
    if dtype is not None:
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False) if dtype is not None else contextlib.nullcontext():
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(hidden, weight, targets, chunk)
        return _loss_only(hidden, weight, targets, chunk)


def _log_probs(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """log-softmax of one chunk's logits, in at least fp32: the upcast happens inside the
    softmax kernel (one read of the matmul's output, one write), not as a separate copy."""
    return torch.log_softmax(hidden @ weight.t(), dim=-1, dtype=torch.promote_types(hidden.dtype, torch.float32))


def _loss_only(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    total = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, hidden.shape[0], chunk):
        logp = _log_probs(hidden[start:start + chunk], weight)
        total += F.nll_loss(logp, targets[start:start + chunk], reduction="sum")
    return total / hidden.shape[0]


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients chunk by chunk in forward; backward scales what is stored.
    Per logit that is three passes (log-softmax, exp in place, the cast for the matmuls)
    where the unfused path makes about six, on a tensor a chunk instead of all tokens long."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        wide = torch.promote_types(hidden.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if want_h else None
        # fp32 accumulator: chunks add up without bf16 rounding in between
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=wide) if want_w else None
        total = torch.zeros((), device=hidden.device, dtype=wide)
        rows = torch.arange(min(chunk, n), device=hidden.device)
        for start in range(0, n, chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logp = _log_probs(h, weight)
            total += F.nll_loss(logp, t, reduction="sum")
            # d(mean loss)/d(logits) = (softmax - onehot) / n; the 1/n is applied to the
            # [chunk, dim] results, not to the [chunk, vocab] probabilities
            grad = logp.exp_()
            grad[rows[:len(t)], t] -= 1.0
            grad = grad.to(hidden.dtype)
            if want_h:
                grad_h[start:start + chunk] = (grad @ weight).mul_(1.0 / n)
            if want_w:
                grad_w.add_(grad.t() @ h, alpha=1.0 / n)
        ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
        ctx.weight_dtype, ctx.wants = weight.dtype, (want_h, want_w)
        return total / n

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        want_h, want_w = ctx.wants
        grad_h = next(saved) * grad_out if want_h else None  # a 0-dim factor keeps grad_h's dtype
        grad_w = (next(saved) * grad_out).to(ctx.weight_dtype) if want_w else None
        return grad_h, grad_w, None, None
