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


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide the model's size, and the one parameter count both the
    refusal floor here and the layout planner (memory_plan.py) use, so they cannot drift."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    tie_embeddings: bool

    @classmethod
    def of(cls, model, vocab_size: int) -> ModelShape:
        """From a ModelConfig (or ModelArgs) and the resolved vocabulary size."""
        hidden = ffn_hidden(model.dim, model.multiple_of, model.ffn_dim_multiplier)
        return cls(model.n_layers, model.dim, model.n_heads, model.n_kv_heads or model.n_heads, hidden,
                   vocab_size, model.tie_embeddings)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.dim // self.n_heads)

    @property
    def block_params(self) -> int:
        attention = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim
        return attention + 3 * self.dim * self.ffn_hidden + 2 * self.dim  # + the two norms

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * self.block_params + embeddings + self.dim


def count_params(m: ModelConfig, vocab_size: int) -> int:
    """Parameters of the model `m` describes with this vocabulary."""
    return ModelShape.of(m, vocab_size).params


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
