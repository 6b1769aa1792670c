"""How big the planned model is, from its config alone (no torch): parameters and the
bytes one training checkpoint takes.

The supervisor uses it before anything starts (is there room for two checkpoints?);
anything else that must size the model without building it can too. The parameter
count follows worker/model.py's Llama layout exactly (tests/gpuherd/test_model_size.py
compares it with the built model).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuherd.config import ModelConfig

# What a checkpoint stores per parameter: the fp32 weight and AdamW's two fp32 moments.
# (Gradients are not saved; RNG and sampler states are a few KB.)
CHECKPOINT_BYTES_PER_PARAM = 4 + 4 + 4


def ffn_hidden(m: ModelConfig) -> int:
    """SwiGLU width: Llama's 2/3 of 4*dim, optionally scaled, rounded up to multiple_of."""
    hidden = int(2 * 4 * m.dim / 3)
    if m.ffn_dim_multiplier is not None:
        hidden = int(m.ffn_dim_multiplier * hidden)
    return m.multiple_of * ((hidden + m.multiple_of - 1) // m.multiple_of)


def parameter_count(m: ModelConfig, vocab_size: int) -> int:
    """Trainable parameters of the model `m` describes with a `vocab_size`-row embedding."""
    head_dim = m.dim // m.n_heads
    kv = (m.n_kv_heads or m.n_heads) * head_dim
    attention = m.dim * m.dim * 2 + m.dim * kv * 2  # wq, wo; wk, wv
    feed_forward = 3 * m.dim * ffn_hidden(m)  # w1, w2, w3
    layer = attention + feed_forward + 2 * m.dim  # + attention_norm, ffn_norm
    embeddings = vocab_size * m.dim * (1 if m.tie_embeddings else 2)  # tok_embed (+ output)
    return m.n_layers * layer + embeddings + m.dim  # + the final norm


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    checkpoint_bytes: int

    @classmethod
    def of(cls, m: ModelConfig, vocab_size: int) -> ModelSize:
        n = parameter_count(m, vocab_size)
        return cls(parameters=n, checkpoint_bytes=n * CHECKPOINT_BYTES_PER_PARAM)


def human_count(n: float) -> str:
    """123587328 -> '123.6M', 6083055616 -> '6.08B'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as `df -H` and disk vendors count)."""
    units = ("B", "KB", "MB", "GB", "TB", "PB")
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n /= 1000
        i += 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"
