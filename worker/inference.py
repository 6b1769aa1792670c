"""Loading any gpuherd checkpoint for inference, and KV-cached sampling."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuherd.checkpoint_layout import META, latest_checkpoint
from gpuherd.exit_codes import ExitCode
from worker.checkpoint_io import FORMAT_DCP, FORMAT_DEEPSPEED, load_file, read_meta
from worker.distributed import WorkerError
from worker.model import KVCache, ModelArgs, Transformer


@dataclass
class Loaded:
    model: Transformer
    tokenizer: Any
    tokenizer_spec: str
    eot_id: int
    step: int
    n_params: int
    path: Path


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint file/dir, or a directory of them (its latest)."""
    if not path.exists():
        raise WorkerError(f"checkpoint not found: {path}", ExitCode.USAGE)
    if path.is_dir() and not (path / META).exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise WorkerError(f"{path} holds no complete gpuherd checkpoint (step_*.pt or step_*/ with {META})",
                              ExitCode.USAGE)
        return latest
    return path


def load_state(path: Path, meta: dict[str, Any], model: Transformer) -> dict[str, torch.Tensor]:
    """The model weights of any layout, as a plain state dict on CPU."""
    fmt = meta.get("format") if path.is_dir() else None
    if fmt == FORMAT_DCP:
        import torch.distributed.checkpoint as dcp

        state = {"model": {k: torch.empty_like(v, device="cpu") for k, v in model.state_dict().items()}}
        dcp.load(state, checkpoint_id=path, no_dist=True)  # one process reads every shard itself
        return state["model"]
    if fmt == FORMAT_DEEPSPEED:
        os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
        try:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        except ImportError:
            raise WorkerError(f"{path} is a DeepSpeed checkpoint; reading it needs the deepspeed package",
                              ExitCode.USAGE) from None
        return get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ds")
    if path.is_dir():
        raise WorkerError(f"{path}: unknown checkpoint format {fmt!r}", ExitCode.USAGE)
    return load_file(path)["model"]


def load_for_inference(path: Path, device: torch.device) -> Loaded:
    path = resolve_checkpoint(path)
    meta = read_meta(path)
    if "model_args" not in meta:
        raise WorkerError(f"{path} is not a gpuherd training checkpoint (no model description)", ExitCode.USAGE)
    args = ModelArgs(**meta["model_args"])
    spec = str(meta.get("tokenizer", ""))
    if spec in ("", "in-memory"):
        raise WorkerError(f"{path} was trained on in-memory tokens: it names no tokenizer to encode a prompt with",
                          ExitCode.USAGE)
    from dataset_cache import DatasetError, load_tokenizer

    try:
        tokenizer = load_tokenizer(spec)
    except DatasetError as exc:
        raise WorkerError(f"tokenizer of {path}: {exc}", ExitCode.DATA) from None
    if tokenizer.vocab_size > args.vocab_size:
        raise WorkerError(f"{path}: tokenizer {spec} has {tokenizer.vocab_size} tokens but the model only "
                          f"{args.vocab_size}: checkpoint and tokenizer do not belong together", ExitCode.USAGE)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")  # no random init: every weight comes from the checkpoint
    model.init_rope(torch.device("cpu"))
    state = load_state(path, meta, model)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = " ".join(str(exc).split())[:300]
        raise WorkerError(f"{path}: weights do not fit the model it describes: {first}", ExitCode.USAGE) from None
    model.to(device).eval()
    return Loaded(model, tokenizer, spec, int(tokenizer.eot_id), int(meta.get("step", 0)), model.num_params(), path)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, temperature: float, top_k: int,
             generator: torch.Generator, stop_id: int | None = None) -> list[int]:
    """Prompt + up to max_new_tokens sampled ids. The prompt is prefilled once;
    every new token is one forward step over the KV cache."""
    limit = model.args.max_seq_len
    if len(prompt) >= limit:
        prompt = prompt[-(limit - 1):]  # keep the end: the part the next token depends on
    max_new_tokens = min(max_new_tokens, limit - len(prompt))
    device = model.tok_embed.weight.device
    cache = KVCache(model.args, 1, len(prompt) + max_new_tokens, device, model.tok_embed.weight.dtype)
    logits = model(torch.tensor([prompt], device=device), cache=cache)[:, -1]
    out = list(prompt)
    for _ in range(max_new_tokens):
        token = sample(logits.float(), temperature, top_k, generator)
        out.append(token)
        if token == stop_id or len(out) >= limit:
            break
        logits = model(torch.tensor([[token]], device=device), cache=cache)[:, -1]
    return out


def sample(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax(dim=-1))
    logits = logits / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
