"""How big a configured model is, without torch: parameters, the bytes its training
state takes (weights + gradients + AdamW moments, after sharding), and a micro-batch's
activations. Used to refuse a model that cannot fit before anything is spawned, and to
say how much room a checkpoint needs.

The counts follow worker/model.py exactly (a test builds the model and compares);
the byte figures are deliberate under-estimates (no CUDA context, allocator slack or
temporary buffers), so a refusal means the model cannot fit, never "might not".
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuherd.config import ModelConfig, TrainingConfig

FP32 = 4
# AdamW in fp32 keeps the weights, their gradients and two moments: 4 values per parameter.
WEIGHT_GRAD_BYTES = 2 * FP32
OPTIMIZER_BYTES = 2 * FP32
CHECKPOINT_BYTES_PER_PARAM = FP32 + OPTIMIZER_BYTES  # a checkpoint holds weights + moments
# Values a transformer block keeps for backward per token and per model dim (Korthikanti
# et al. 2022, "Reducing Activation Recomputation": 34 bytes in 16-bit, attention scores
# excluded because sdpa/flash attention never materialise them).
ACTIVATION_VALUES_PER_DIM = 17
GPT2_PADDED_VOCAB = 50304  # the default tokenizer's, when neither config nor caller says


@dataclass(frozen=True)
class ModelMemory:
    params: int
    state_bytes: int  # weights + gradients + optimizer, per worker
    activation_bytes: int  # one micro-batch, per worker

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes


def ffn_hidden(dim: int, multiple_of: int, multiplier: float | None) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim, optionally scaled, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def count_params(m: ModelConfig, vocab_size: int) -> int:
    head_dim = m.dim // m.n_heads
    kv_dim = (m.n_kv_heads or m.n_heads) * head_dim
    attention = 2 * m.dim * m.dim + 2 * m.dim * kv_dim
    feed_forward = 3 * m.dim * ffn_hidden(m.dim, m.multiple_of, m.ffn_dim_multiplier)
    per_layer = attention + feed_forward + 2 * m.dim  # + two RMSNorm weights
    embeddings = vocab_size * m.dim * (1 if m.tie_embeddings else 2)
    return embeddings + m.n_layers * per_layer + m.dim


def estimate_bytes(model_cfg: ModelConfig, training_cfg: TrainingConfig, world_size: int, *,
                   context_length: int = 2048, vocab_size: int | None = None) -> ModelMemory:
    """Per-worker memory of training this model with `world_size` workers."""
    vocab = model_cfg.vocab_size or vocab_size or GPT2_PADDED_VOCAB
    params = count_params(model_cfg, vocab)
    return ModelMemory(params=params, state_bytes=_state_bytes(params, training_cfg.strategy, world_size),
                       activation_bytes=_activation_bytes(model_cfg, training_cfg, context_length, vocab))


def checkpoint_bytes(params: int) -> int:
    return params * CHECKPOINT_BYTES_PER_PARAM


def _state_bytes(params: int, strategy: str, world_size: int) -> int:
    n = max(1, world_size)
    if strategy in ("fsdp", "deepspeed"):  # DeepSpeed's stage is in its JSON: assume the most sharded
        return params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES) // n
    if strategy == "zero1":
        return params * WEIGHT_GRAD_BYTES + params * OPTIMIZER_BYTES // n
    return params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES)


def _activation_bytes(m: ModelConfig, t: TrainingConfig, context_length: int, vocab: int) -> int:
    tokens = t.batch_size * context_length
    value = 2 if t.use_amp else FP32  # autocast keeps activations in bf16/fp16
    per_layer = ACTIVATION_VALUES_PER_DIM * m.dim * value
    if t.gradient_checkpointing:  # only each block's input stays; one block is recomputed at a time
        blocks = m.n_layers * m.dim * value + per_layer
    else:
        blocks = m.n_layers * per_layer
    logits = 2 * vocab * FP32  # fp32 logits and their gradient for the cross-entropy
    return tokens * (blocks + logits)
