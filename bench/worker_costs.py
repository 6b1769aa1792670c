"""What one training micro-step of the worker's model costs, measured on the meta device
(shapes only: no memory, no time, so the 1B shape is measured on any laptop).

- FLOPs: torch's FlopCounterMode over a real forward + backward, per token, next to the
  6N + 12LHQT the step line's MFU uses (worker/mfu.py).
- Elementwise traffic: bytes read and written by every op that is not a matmul (norms,
  RoPE, SwiGLU's gate, residual adds, casts, the loss), i.e. what eager mode streams
  through memory besides the tensor-core work; torch.compile fuses most of it. The
  attention kernel itself is left out (a flash kernel's traffic is its inputs and
  output, not the T x T scores the meta device's math fallback would count).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from worker.loss import linear_cross_entropy
from worker.mfu import FlopsModel
from worker.model import ModelArgs, Transformer

MATMULS = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm}
# Ops that touch only the indexed elements of a big operand: counted by what they touch.
GATHERS = {torch.ops.aten.index, torch.ops.aten.gather, torch.ops.aten.nll_loss_forward, torch.ops.aten.embedding}
SCATTERS = {torch.ops.aten.index_put_, torch.ops.aten.index_put}
H100_BF16 = 989e12  # dense bf16 FLOP/s
H100_HBM = 3.35e12  # bytes/s (SXM5)


class Traffic(TorchDispatchMode):
    """Bytes in + out of every non-matmul, non-view op, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket
        if op in MATMULS or func.is_view:
            return out
        if op in GATHERS:  # read what is gathered, write it
            touched = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)] * 2
        elif op in SCATTERS:  # read and write the elements put (the values argument)
            touched = [args[2]] * 2
        else:
            touched = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.bytes[op.__name__] += sum(t.numel() * t.element_size() for t in touched)
        return out


def _model(model_cfg, vocab: int, seq_len: int) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(model_cfg, vocab, seq_len))
    # a flash kernel's stand-in: reads q (k, v are read too; small with GQA), writes the output
    for layer in model.layers:
        layer.attention.attend = lambda q, k, v: q * 1.0
    return model


def flops_per_token(model_cfg, vocab: int, seq_len: int) -> dict[str, float]:
    """Counted (FlopCounterMode, forward + backward) vs the 6N + 12LHQT formula."""
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(model_cfg, vocab, seq_len))
    model.set_attention_backend("eager")  # plain matmuls: every attention FLOP is counted
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    a = model.args
    formula = FlopsModel.for_model(model.num_params(matmul_only=True), a.n_layers, a.n_heads, a.head_dim,
                                   seq_len, "").flops_per_token
    counted = counter.get_total_flops() / seq_len
    return {"formula": formula, "counted": counted, "ratio": counted / formula}


def _traffic_of(fn) -> Counter[str]:
    with Traffic() as mode:
        fn()
    return mode.bytes


def elementwise_traffic(model_cfg, vocab: int, seq_len: int, batch: int) -> dict[str, Any]:
    """Bytes of one bf16 micro-step (forward + backward): per block, and the output head
    with the fused chunked loss vs full fp32 logits."""
    model = _model(model_cfg, vocab, seq_len).to(torch.bfloat16)
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    whole = _traffic_of(lambda: model(tokens, tokens).backward())
    hidden = torch.zeros(batch * seq_len, model.args.dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = model.output.weight if model.output is not None else model.tok_embed.weight
    targets = tokens.flatten()
    fused = _traffic_of(lambda: linear_cross_entropy(hidden, weight, targets).backward())
    full = _traffic_of(lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets).backward())
    block_bytes = (sum(whole.values()) - sum(fused.values())) / model.args.n_layers
    a = model.args
    block_flops = 6 * batch * seq_len * _block_params(model) + 12 * a.n_heads * a.head_dim * seq_len * batch * seq_len
    return {
        "tokens": batch * seq_len, "block_bytes": block_bytes, "head_bytes_fused": sum(fused.values()),
        "head_bytes_full_logits": sum(full.values()), "block_flops": block_flops,
        "block_ms_matmul_at_h100_peak": 1e3 * block_flops / H100_BF16,
        "block_ms_elementwise_at_h100_hbm": 1e3 * block_bytes / H100_HBM,
        "top_ops": [(name, b / a.n_layers) for name, b in (whole - fused).most_common(6)],
    }


def _block_params(model: Transformer) -> int:
    return sum(p.numel() for p in model.layers[0].parameters())
