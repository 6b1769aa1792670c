"""Which parallel layout a run trains with, from how much GPU memory one rank needs
under each, estimated before anything is built (model_size.py holds the plain counts
and the conservative lower bound used to refuse a model outright).

torch-free, so the supervisor can ask too. The model is the worker's Llama-style
decoder (worker/model.py); counts are exact, memory is an estimate of what a rank
holds at its peak, in four parts:

- state: parameters, gradients and AdamW's two moments. Single/DDP keep fp32
  master weights and fp32 gradients (16 B/param) plus the bf16 copies autocast
  makes for the matmuls (2 B/param); FSDP shards those 16 B over the ranks and
  holds two blocks unsharded in bf16 at a time (the one computing, the one prefetched).
- accumulated gradients: FSDP without a reduce-scatter per micro-batch keeps every
  unsharded gradient in fp32 until the last micro-batch (4 B/param on every rank).
- activations: what backward needs of each block, per token, in bf16: the block
  input, both norm outputs, q/k/v and the attention output, the residual, and the
  SwiGLU's two projections, their product and silu: 2 * (6*dim + 2*kv_dim + 4*ffn)
  bytes. Activation checkpointing keeps only the block input per layer plus one
  block's worth being recomputed.
- the output: the chunked cross-entropy's fp32 logits of one chunk (twice: logits and
  their gradient) and the hidden states' gradient.

A fixed allowance covers the CUDA context, NCCL buffers and allocator slack.

Host memory besides: live recovery of an FSDP run keeps copies of each rank's shard in host
memory (`shard_copy_bytes`), checked at launch against the host's RAM with the processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuherd.model_size import ModelShape

GIB = 1024**3
CONTEXT_OVERHEAD = 3 * GIB  # CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation
SAFETY = 1.10  # estimates err low (temporaries, fragmentation); plan as if 10% more were needed
CE_CHUNK_BYTES = 256 * 1024**2  # fp32 logits of one cross-entropy chunk (worker/loss.py)


# Live recovery of FSDP (worker/shard_copies.py): each rank keeps, in host memory, its own snapshots of
# its last two steps and its neighbour's last complete copy beside the one arriving: 4 copies of a
# shard of the fp32 weights and AdamW's two moments (12 B per parameter).
SHARD_COPIES = 4
SHARD_STATE_BYTES_PER_PARAM = 12


def shard_copy_bytes(params: int, world_size: int) -> int:
    """Host memory one FSDP rank holds for its shard copies (the uneven last shard: rounded up)."""
    return SHARD_COPIES * SHARD_STATE_BYTES_PER_PARAM * -(-params // max(1, world_size))


def ce_chunk_tokens(vocab_size: int, dim: int) -> int:
    """Tokens per chunk of the fused cross-entropy (worker/loss.py): fp32 logits of about
    CE_CHUNK_BYTES, but at least 2*dim tokens, because every chunk also adds its share
    of the output weight's gradient ([vocab, dim], ~10 B per element) into an fp32
    accumulator: fewer, larger chunks keep that traffic below the logits' own."""
    return max(1, CE_CHUNK_BYTES // (4 * vocab_size), 2 * dim)


@dataclass(frozen=True)
class Layout:
    """One way to lay a model out over the ranks."""

    strategy: str  # single | ddp | fsdp
    checkpointing: bool = False  # activation checkpointing per block
    reduce_every_micro_batch: bool = False  # FSDP: gradients stay sharded between micro-batches

    def describe(self) -> str:
        parts = [self.strategy]
        if self.checkpointing:
            parts.append("activation checkpointing")
        if self.reduce_every_micro_batch:
            parts.append("per-micro-batch reduce-scatter")
        return " + ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What one rank processes per optimizer step."""

    world_size: int
    micro_batch: int
    seq_len: int
    grad_accum: int


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    parts: dict[str, int] = field(default_factory=dict)  # bytes by part

    @property
    def total(self) -> int:
        return int(sum(self.parts.values()) * SAFETY)

    def gib(self) -> str:
        return f"{self.total / GIB:.1f} GiB"


def estimate_bytes(shape: ModelShape, layout: Layout, work: Workload) -> Estimate:
    """Peak bytes one rank needs to train `shape` laid out as `layout` (see the module doc)."""
    n, world = shape.params, work.world_size
    tokens = work.micro_batch * work.seq_len
    if layout.strategy == "fsdp":
        state = 16 * n // world + 2 * 2 * shape.block_params
    else:
        state = 18 * n
    accumulated = 0
    if layout.strategy == "fsdp" and work.grad_accum > 1 and not layout.reduce_every_micro_batch:
        accumulated = 4 * n
    per_layer = 2 * (6 * shape.dim + 2 * shape.kv_dim + 4 * shape.ffn_hidden) * tokens
    if layout.checkpointing:
        activations = 2 * shape.dim * tokens * shape.n_layers + per_layer
    else:
        activations = per_layer * shape.n_layers
    chunk_logits = 4 * shape.vocab_size * min(tokens, ce_chunk_tokens(shape.vocab_size, shape.dim))
    output = 2 * chunk_logits + 2 * shape.dim * tokens * 4  # logits + grad; hidden, norm out, grads
    return Estimate(layout, {"state": state, "accumulated_grads": accumulated, "activations": activations,
                             "output": output, "overhead": CONTEXT_OVERHEAD})


def candidate_layouts(world_size: int, grad_accum: int) -> list[Layout]:
    """Fastest first: no sharding, sharding, then recomputation, then per-micro-batch
    reduce-scatters (one more collective per micro-batch)."""
    if world_size == 1:  # sharding over one rank saves nothing
        return [Layout("single"), Layout("single", checkpointing=True)]
    ladder = [Layout("ddp"), Layout("fsdp")]
    if grad_accum > 1:
        ladder.append(Layout("fsdp", reduce_every_micro_batch=True))
    ladder.append(Layout("fsdp", checkpointing=True))
    if grad_accum > 1:
        ladder.append(Layout("fsdp", checkpointing=True, reduce_every_micro_batch=True))
    return ladder


@dataclass(frozen=True)
class Choice:
    """The layout to train with, its estimate, and whether that fits the device."""

    estimate: Estimate
    device_bytes: int
    fits: bool
    chosen: bool  # True: picked by the estimate (strategy auto); False: the user's own layout

    @property
    def layout(self) -> Layout:
        return self.estimate.layout

    def note(self) -> str:
        """`chosen by memory estimate: ~55.3 GiB of 79.1 GiB per GPU` (for the start-up line)."""
        how = "chosen by memory estimate" if self.chosen else "as configured"
        return f"{how}: ~{self.estimate.gib()} of {self.device_bytes / GIB:.1f} GiB per GPU"


def choose_layout(shape: ModelShape, work: Workload, device_bytes: int, strategy: str = "auto",
                  checkpointing: bool = False) -> Choice | None:
    """The fastest layout whose estimate fits `device_bytes`.

    `strategy=auto` decides the strategy, activation checkpointing and the FSDP reduce
    cadence; an explicit `fsdp` only the reduce cadence (it changes no numbers worth
    speaking of); any other explicit strategy is estimated as configured. Activation
    checkpointing the user asked for is never turned off. None for strategies this
    model cannot estimate (zero1, deepspeed: their sharding is configured elsewhere).
    """
    if strategy == "auto":
        ladder = candidate_layouts(work.world_size, work.grad_accum)
    elif strategy == "fsdp":
        ladder = [Layout("fsdp")] + ([Layout("fsdp", reduce_every_micro_batch=True)]
                                      if work.world_size > 1 and work.grad_accum > 1 else [])
    elif strategy in ("single", "ddp"):
        ladder = [Layout(strategy)]
    else:
        return None
    if checkpointing:
        ladder = list(dict.fromkeys(Layout(lay.strategy, True, lay.reduce_every_micro_batch) for lay in ladder))
    estimates = [estimate_bytes(shape, layout, work) for layout in ladder]
    for estimate in estimates:
        if estimate.total <= device_bytes:
            return Choice(estimate, device_bytes, fits=True, chosen=strategy == "auto")
    return Choice(estimates[-1], device_bytes, fits=False, chosen=strategy == "auto")
