"""The output projection and cross-entropy, fused and chunked over tokens.

The plain `F.cross_entropy(F.linear(h, W).float(), targets)` materialises the
whole [tokens, vocab] logits in fp32, keeps them for backward and streams them
through memory four or five times: for GPT-2's 50k vocabulary and 16k tokens per
micro-batch that is 3.3 GB per copy, about as much traffic as every elementwise
op of the model's blocks together. Here the logits exist one chunk of tokens at a
time: each chunk's loss and its gradients (w.r.t. the hidden states and the
weight, softmax minus one-hot) are computed right away in forward, so backward
only hands out the stored gradients and no chunk is ever recomputed. This is the
technique of Liger-Kernel's fused linear cross-entropy, written with torch ops.
"""

from __future__ import annotations

import torch

# fp32 logits per chunk: big enough that each chunk's matmuls saturate a GPU,
# small enough that the peak stays far below one full-vocabulary copy.
CHUNK_BYTES = 256 * 1024**2


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, chunk_bytes // (4 * vocab_size))


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None) -> torch.Tensor:
    """mean(cross_entropy(hidden @ weight.T, targets)) in fp32, without full logits.

    hidden [N, D], weight [V, D], targets [N]. The matmuls run in autocast's dtype
    when autocast is on (as `F.linear` would), else in hidden's; softmax and the
    loss are always fp32.
    """
    chunk = chunk or chunk_tokens(weight.shape[0])
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device_type, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(hidden, weight, targets, chunk)
        return _loss_only(hidden, weight, targets, chunk)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits in at least fp32, log-sum-exp, summed loss) of one chunk."""
    logits = (hidden @ weight.t()).to(torch.promote_types(hidden.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)
    loss = (lse - logits.gather(1, targets[:, None]).squeeze(1)).sum()
    return logits, lse, loss


def _loss_only(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    total = torch.zeros((), device=hidden.device, dtype=torch.promote_types(hidden.dtype, torch.float32))
    for start in range(0, hidden.shape[0], chunk):
        total += _chunk_logits(hidden[start:start + chunk], weight, targets[start:start + chunk])[2]
    return total / hidden.shape[0]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        n = hidden.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        # fp32 accumulator: chunks add up without bf16 rounding in between
        wide = torch.promote_types(hidden.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=wide) if want_w else None
        total = torch.zeros((), device=hidden.device, dtype=wide)
        rows = torch.arange(min(chunk, n), device=hidden.device)
        for start in range(0, n, chunk):
            h, t = hidden[start:start + chunk], targets[start:start + chunk]
            logits, lse, loss = _chunk_logits(h, weight, t)
            total += loss
            # d(mean loss)/d(logits) = (softmax - onehot) / n, computed in place over the logits
            grad = logits.sub_(lse[:, None]).exp_()
            grad[rows[:len(t)], t] -= 1.0
            grad = grad.div_(n).to(hidden.dtype)
            if want_h:
                grad_h[start:start + chunk] = grad @ weight
            if want_w:
                grad_w += grad.t() @ h
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
