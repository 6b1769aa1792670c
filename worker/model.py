"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Parameter names follow torchtitan (`tok_embed`, `layers.{i}.attention.wq`,
`layers.{i}.feed_forward.w1`, `norm`, `output`); the NaN report prints them as is.
The model is built on the meta device and materialised by `init_weights()`
after sharding, so a large model never exists in full on one rank. Weights are
drawn parameter by parameter from one seeded generator over the *full* shape
and then sliced to the local shard: every strategy and world size starts from
the same numbers, which is what lets tests compare their loss curves.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gpuherd.config import ModelConfig
from gpuherd.model_size import ffn_hidden
from worker.attention import get_attention
from worker.loss import autocast_dtype, linear_cross_entropy

# A kernel choice, not part of the model: the same weights load under any backend.
NOT_IN_CHECKPOINT = ("attention",)


@dataclass
class ModelArgs(ModelConfig):
    """`ModelConfig` with what the data decides resolved: the vocabulary size (never 0),
    `n_kv_heads` (never None) and the context length. A field added to ModelConfig
    reaches the model (and the checkpoint's description of it) with no second declaration."""

    max_seq_len: int = field(kw_only=True)

    @classmethod
    def from_config(cls, m: ModelConfig, vocab_size: int, max_seq_len: int) -> ModelArgs:
        values = {f.name: getattr(m, f.name) for f in fields(m)}
        values.update(n_kv_heads=m.n_kv_heads or m.n_heads, vocab_size=vocab_size)
        return cls(**values, max_seq_len=max_seq_len)

    def checkpoint_dict(self) -> dict[str, Any]:
        """What a checkpoint records to recognise its model (and rebuild it for generation)."""
        return {k: v for k, v in asdict(self).items() if k not in NOT_IN_CHECKPOINT}

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """Llama's rule (one definition, shared with the torch-free size estimate)."""
        return ffn_hidden(self.dim, self.multiple_of, self.ffn_dim_multiplier)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise and scale in fp32 (bf16 squares lose too much), return in the input
        # dtype, so a bf16 residual stream stays bf16 (an fp32 weight under autocast would
        # otherwise promote it). Under torch.compile this is one fused kernel.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim/2], always float32: in bf16 the angles of late
    positions lose their low bits and every strategy would rotate differently."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] with (even, odd) pairs rotated, as Llama's complex form does.

    No upcast copy of x: multiplying by the fp32 tables promotes each product, so the
    rotation is computed in fp32 and rounded once; compiled, it is one kernel that
    reads x once and writes the result once."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).to(x.dtype)


class KVCache:
    """Per-layer key/value buffers for generation; `pos` tokens are filled."""

    def __init__(self, args: ModelArgs, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (batch, max_len, args.n_kv_heads, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.max_len = max_len
        self.pos = 0

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.pos + k.shape[1]
        self.k[layer][:, self.pos:end] = k
        self.v[layer][:, self.pos:end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.attend = get_attention("sdpa")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_id, k, v)
        return self.wo(self.attend(q, k, v).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int) -> None:
        super().__init__()
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.checkpointed = False  # training.gradient_checkpointing

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if self.checkpointed and self.training and torch.is_grad_enabled():
            # Recompute this block in backward instead of storing its activations.
            return checkpoint(self._forward, x, cos, sin, None, use_reentrant=False)
        return self._forward(x, cos, sin, cache)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied: the output projection reads tok_embed.weight directly, so there is one
        # parameter and nothing for meta-device materialisation or sharding to untie.
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # The rotary tables are a plain attribute, not a buffer: whatever casts the module
        # (DeepSpeed's module.bfloat16(), FSDP's forward-input casting, .to(dtype)) never
        # sees them, so they stay float32 under every strategy. Built on first use.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ setup
    def set_attention_backend(self, backend: str) -> None:
        for layer in self.layers:
            layer.attention.attend = get_attention(backend)

    def set_gradient_checkpointing(self, enabled: bool) -> None:
        for layer in self.layers:
            layer.checkpointed = enabled

    @torch.no_grad()
    def init_rope(self, device: torch.device) -> None:
        """The float32 rotary tables on `device` (forward rebuilds them if the model moved)."""
        self._rope = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta, device=device)

    def rope(self, start: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions [start, start + length), float32, on `device`."""
        if self._rope is None or self._rope[0].device != device:
            self.init_rope(device)
        cos, sin = self._rope
        return cos[start:start + length], sin[start:start + length]

    @torch.no_grad()
    def init_weights(self, seed: int, device: torch.device) -> None:
        """Materialised (possibly sharded) parameters <- deterministic values.

        Norms start at 1; embeddings and input projections ~ N(0, init_std);
        projections that write into the residual stream (wo, w2) are scaled by
        1/sqrt(2 * n_layers) as in GPT-2, so the residual variance does not
        grow with depth; the output head ~ N(0, dim^-0.5) (torchtitan).
        """
        args = self.args
        self.init_rope(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        residual_std = args.init_std / math.sqrt(2 * args.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                _fill_from_full(param, lambda shape: torch.ones(shape, device=device))
                continue
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                std = residual_std
            elif name == "output.weight":
                std = args.dim ** -0.5
            else:
                std = args.init_std
            _fill_from_full(param, lambda shape, s=std: torch.empty(shape, device=device).normal_(0.0, s, generator=gen))

    # ------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Training: tokens, targets [B, T] -> mean cross-entropy (scalar, fp32).
        Inference: logits [B, T, V] (with `cache`, positions continue at cache.pos)."""
        t = tokens.shape[1]
        start = cache.pos if cache is not None else 0
        if start + t > self.args.max_seq_len:
            raise ValueError(f"sequence of {start + t} tokens exceeds the model's context {self.args.max_seq_len}")
        cos, sin = self.rope(start, t, tokens.device)
        h = self.tok_embed(tokens)
        compute = autocast_dtype(h.device.type)
        if compute is not None:
            # The residual stream in the compute dtype (an fp32 embedding table would
            # make it fp32 and double every elementwise op's traffic).
            h = h.to(compute)
        for layer in self.layers:
            h = layer(h, cos, sin, cache)
        h = self.norm(h)
        head = self.tok_embed.weight if self.output is None else self.output.weight
        if cache is not None:
            cache.pos += t
        if targets is None:
            return F.linear(h, head)
        return linear_cross_entropy(h.flatten(0, 1), head, targets.flatten())

    # ------------------------------------------------------------------ accounting
    def num_params(self, matmul_only: bool = False) -> int:
        """All parameters, or (matmul_only) those doing multiply-adds per token: the
        token-embedding lookup costs no FLOPs, unless it doubles as the tied output."""
        total = sum(p.numel() for p in self.parameters())
        if matmul_only and self.output is not None:
            total -= self.tok_embed.weight.numel()
        return total


def _fill_from_full(param: torch.Tensor, make_full) -> None:
    """Write `make_full(full_shape)` into `param`, keeping only this rank's shard
    when `param` is a DTensor (FSDP2); the full tensor exists one parameter at a time."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        full = make_full(param.shape)
        # src_data_rank=None: every rank made the same full tensor, slice locally, no comms
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(make_full(param.shape))
