"""Shared pieces for the NaN forensics tests: a tiny Llama-shaped model whose
parameter names follow seed 003, real ways to make it go non-finite, a loguru
capture, and a 2-rank gloo training script (run as `python tests/worker/nan/helpers.py`).

Ways to get REAL non-finite values out of TinyLM (no injected flags):
- POISON token (the last id): its embedding row is 1e20, so `magnitude`
  squares it past float32 and the loss becomes NaN -> "NaN LOSS".
- PAD token (id 0, `padding_idx`, a zero row): `magnitude` takes sqrt(0),
  forward stays finite but backward is 0 * inf = NaN -> "NaN GRADIENT".
- an Inf written into one weight, or a huge learning rate.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

if __name__ == "__main__":  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from gpuherd.config import Config  # noqa: E402

VOCAB = 32
PAD = 0
POISON = VOCAB - 1
SEED_SNIPPET = '''
import pickle
import numpy as np

# Load debug tensors
with open('.checkpoints/debug/nan_debug_step_0.pkl', 'rb') as f:
    debug_data = pickle.load(f)

# Check which parameters have NaN
for name, param in debug_data['parameters'].items():
    if np.isnan(param).any():
        print(f"{name} has NaN values")

# Check gradients
for name, grad in debug_data['gradients'].items():
    if np.isnan(grad).any():
        nan_ratio = np.isnan(grad).sum() / grad.size
        print(f"{name}: {nan_ratio*100:.1f}% NaN")
'''  # verbatim from seed 003 "Loading Debug Checkpoint"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Magnitude(nn.Module):
    """x + sqrt(mean(proj(x)^2)): harmless for ordinary inputs, the classic
    sqrt-at-zero gradient bug for a zero row, an overflow for a huge row."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(self.proj(x).pow(2).mean(-1, keepdim=True))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 16, heads: int = 2, n_layers: int = 2,
                 init_std: float = 0.02) -> None:
        super().__init__()
        self.tok_embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.magnitude = Magnitude(dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=init_std)
        with torch.no_grad():
            self.tok_embed.weight[PAD].zero_()
            self.tok_embed.weight[vocab - 1].fill_(1e20)  # the POISON row

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.magnitude(self.tok_embed(ids[:, :-1]))
        for layer in self.layers:
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def clean_batch(seed: int, batch: int = 2, length: int = 9, vocab: int = VOCAB) -> torch.Tensor:
    """Token ids avoiding PAD and POISON."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (batch, length), generator=g)


def with_token(batch: torch.Tensor, token: int) -> torch.Tensor:
    out = batch.clone()
    out[-1, 3] = token
    return out


def make_config(checkpoint_dir: Path, hooks: bool = True, policy: str = "stop", max_skips: int = 3,
                max_dump_mb: int = 1024) -> Config:
    cfg = Config()
    cfg.system.checkpoint_dir = str(checkpoint_dir)
    cfg.debug.nan_hooks = hooks
    cfg.debug.nan_policy = policy
    cfg.debug.max_nan_skips = max_skips
    cfg.debug.max_dump_mb = max_dump_mb
    return cfg


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, guard, step: int,
               micro_batches: list[torch.Tensor], lr: float, max_norm: float | None = 1.0) -> bool:
    """The loop the worker runs, reduced to what the guard sees (`max_norm=None`:
    no clipping, the guard computes the norm itself)."""
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for mb in micro_batches:
        loss = model(mb) / len(micro_batches)
        loss.backward()
        total = total + loss.detach()
    grad_norm = None if max_norm is None else torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    apply = guard.check(step=step, loss=total, grad_norm=grad_norm, batches=micro_batches, lr=lr)
    if apply:
        optimizer.step()
    return apply


class LogCapture:
    """Every loguru line as `LEVEL | message`, the supervisor-facing format."""

    def __init__(self) -> None:
        from loguru import logger

        self.lines: list[str] = []
        self._logger = logger
        self._id = logger.add(lambda m: self.lines.append(str(m).rstrip("\n")),
                              format="{level} | {message}", level="DEBUG")

    def close(self) -> None:
        self._logger.remove(self._id)

    def messages(self, level: str = "ERROR") -> list[str]:
        prefix = f"{level} | "
        return [line[len(prefix):] for line in self.lines if line.startswith(prefix)]


def make_guard(model: nn.Module, cfg: Config, save_checkpoint=None, status_fd: int | None = None, rank: int = 0):
    from gpuherd.contract import WorkerIdentity
    from gpuherd.status_channel import StatusWriter
    from worker.nan import NanGuard

    identity = WorkerIdentity(rank=rank, local_rank=rank, world_size=1, local_world_size=1,
                              device_kind="cpu", device_id=rank, supervised=False)
    guard = NanGuard(cfg, model, identity, StatusWriter(status_fd, rank), save_checkpoint)
    guard.attach()
    return guard


class _MakesADirectory:
    """Unpickling this calls os.mkdir(path): a stand-in for any code a crafted pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def planted_dump(path: Path, marker: Path) -> Path:
    """A file shaped like a NaN dump whose loading runs code: it creates `marker` when unpickled."""
    import pickle

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"step": 3, "parameters": {}, "gradients": {}, "x": _MakesADirectory(marker)}))
    return path


def param_checksum(model: nn.Module) -> str:
    """Digest of every weight's (local) bytes: changes whenever an optimizer step is applied."""
    from worker.nan.names import local_tensor

    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(local_tensor(p.detach()).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------- 2-rank script


def run_rank(store: str, out_dir: Path, ckpt_dir: Path, scenario: str) -> int:
    """One gloo rank; writes what it saw to out_dir/rank{r}.json and exits with
    NanStop's code.

    ddp:  DDP, policy skip (max 1 in a row): step 0 POISON on rank 1 (skip),
          step 1 clean (apply), steps 2 and 3 POISON on rank 1 (skip, then stop).
    fsdp: FSDP2 (fully_shard per block, then root), policy stop: step 0 clean,
          step 1 PAD on rank 1 (a backward-only NaN) -> stop."""
    import torch.distributed as dist
    from loguru import logger

    from gpuherd.contract import WorkerIdentity
    from gpuherd.gloo_exit import settle
    from gpuherd.status_channel import StatusWriter
    from worker.nan import NanGuard, NanStop

    torch.set_num_threads(1)
    logger.remove()
    logger.add(sys.stderr, format="{level} | {message}", level="DEBUG")
    identity = WorkerIdentity.from_env()
    dist.init_process_group("gloo", init_method=store, rank=identity.rank, world_size=identity.world_size)
    torch.manual_seed(0)
    if scenario == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(TinyLM())
        state = model.module.state_dict
        cfg = make_config(ckpt_dir, hooks=True, policy="skip", max_skips=1)
        steps = [POISON, None, POISON, POISON]
    else:
        from torch.distributed.fsdp import fully_shard

        model = TinyLM()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)

        def state():  # a full state dict: a collective under FSDP2
            return {k: v.full_tensor() for k, v in model.state_dict().items()}

        cfg = make_config(ckpt_dir, hooks=True, policy="stop")
        steps = [None, PAD]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved: list[str] = []

    def save_checkpoint(path: Path) -> None:
        saved.append(str(path))
        full = state()
        if identity.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(full, path)
        dist.barrier()  # collective, as the worker's sharded save is

    status_fd = os.open(out_dir / f"status{identity.rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    guard = NanGuard(cfg, model, identity, StatusWriter(status_fd, identity.rank), save_checkpoint)
    guard.attach()
    results: dict = {"applied": [], "checksums": [], "saved": saved, "exit": 0}
    code = 0
    try:
        for step, token in enumerate(steps):
            batch = clean_batch(100 * step + identity.rank)
            if identity.rank == 1 and token is not None:
                batch = with_token(batch, token)
            results["applied"].append(train_step(model, opt, guard, step, [batch], lr=0.1))
            results["checksums"].append(param_checksum(model))
    except NanStop as stop:
        code = int(stop.exit_code)
        results.update(exit=code, stop_ranks=stop.ranks, report=str(stop.report) if stop.report else None,
                       checkpoint=str(stop.checkpoint) if stop.checkpoint else None)
    finally:
        guard.detach()
        (out_dir / f"rank{identity.rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()
        settle()  # as the worker does before it exits (gpuherd/gloo_exit.py): else a rare SIGABRT
    return code


if __name__ == "__main__":
    sys.exit(run_rank(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]))
