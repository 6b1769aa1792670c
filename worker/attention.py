"""Causal attention kernels behind one signature, and the choice between them.

All kernels take q [B, T, Hq, D] and k, v [B, S, Hkv, D] (flash-attn's layout,
so the fast path needs no transposes) and return [B, T, Hq, D]. `S >= T`: the
queries are the last T positions of the S keys (prefill with S == T in
training, one query over a KV cache during generation).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpuherd.config import ConfigError

BACKENDS = ("flash_attn", "sdpa", "eager")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flash_attn_installed() -> bool:
    """The package is there; whether it *loads* is `flash_attn_problem`'s question."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def _import_problem() -> str | None:
    """Why `from flash_attn import flash_attn_func` fails here, or None.

    find_spec only finds the files: a wheel built for another torch or CUDA fails
    when its extension loads (ImportError "undefined symbol", OSError for a missing
    libcudart), which would otherwise surface at the first forward."""
    if not flash_attn_installed():
        return "flash-attn not installed"
    try:
        from flash_attn import flash_attn_func  # noqa: F401
    except (ImportError, OSError) as exc:
        first = " ".join(str(exc).split())[:160]
        return f"flash-attn is installed but does not load ({type(exc).__name__}: {first})"
    return None


@functools.cache
def _kernel_problem(device_index: int) -> str | None:
    """A tiny call on the GPU: a build without kernels for this architecture fails here."""
    q = torch.zeros(1, 8, 2, 64, device=torch.device("cuda", device_index), dtype=torch.bfloat16)
    try:
        flash_attention(q, q, q)
    except RuntimeError as exc:
        return f"flash-attn's kernel failed on this GPU ({' '.join(str(exc).split())[:160]})"
    return None


def flash_attn_problem(device: torch.device, dtype: torch.dtype | None) -> str | None:
    """Why flash-attn cannot run on `device` in `dtype` (None: it can)."""
    if device.type != "cuda":
        return "not on CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return "not in bf16/fp16"
    problem = _import_problem()
    if problem is not None:
        return problem
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:  # V100 / T4: "FlashAttention only supports Ampere GPUs or newer"
        return f"compute capability {major}.{minor}; flash-attn needs 8.0 (Ampere) or newer"
    return _kernel_problem(device.index or 0)


def resolve_backend(requested: str, device: torch.device, dtype: torch.dtype | None) -> tuple[str, str]:
    """(backend, reason). `dtype` is the compute dtype (autocast dtype or None = fp32).

    `auto` takes flash-attn where it really runs and says why not otherwise (the
    reason lands in the start-up line); asking for flash_attn where it cannot run is
    a config mistake, so it raises instead of silently degrading.
    """
    if requested not in (*BACKENDS, "auto"):
        raise ConfigError(f"unknown attention backend {requested!r}; choose from auto, {', '.join(BACKENDS)}")
    if requested not in ("auto", "flash_attn"):
        return requested, "requested in model.attention"
    problem = flash_attn_problem(device, dtype)
    if problem is None:
        return "flash_attn", "flash-attn loads and runs here, half precision" if requested == "auto" else \
            "requested in model.attention"
    if requested == "flash_attn":
        raise ConfigError(f"model.attention=flash_attn cannot run here: {problem}; use sdpa or auto instead "
                          "(flash-attn needs the package built for this torch, a CUDA GPU of compute capability "
                          ">= 8.0 and bf16/fp16 autocast, training.use_amp=true)")
    return "sdpa", f"torch scaled_dot_product_attention; {problem}"


def get_attention(backend: str) -> AttentionFn:
    return {"flash_attn": flash_attention, "sdpa": sdpa_attention, "eager": eager_attention}[backend]


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, S, Hkv, D] -> [B, S, Hkv * n_rep, D]: each KV head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, s, h, d = x.shape
    return x[:, :, :, None, :].expand(b, s, h, n_rep, d).reshape(b, s, h * n_rep, d)


def _causal_mask(t: int, s: int, device: torch.device) -> torch.Tensor:
    """Bool [T, S], True = may attend; query i sits at absolute position s - t + i."""
    rows = torch.arange(s - t, s, device=device)[:, None]
    return torch.arange(s, device=device)[None, :] <= rows


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference math, in fp32 softmax; the other kernels are tested against it."""
    n_rep = q.shape[2] // k.shape[2]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs @ v).transpose(1, 2)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t, s = q.shape[1], k.shape[1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if t == s:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    elif t == 1:  # one new token attends to the whole cache: no mask at all
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:  # SDPA's is_causal aligns top-left; a chunk over a cache needs bottom-right
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=_causal_mask(t, s, q.device), enable_gqa=True
        )
    return out.transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from flash_attn import flash_attn_func  # optional dependency, checked by resolve_backend

    # flash-attn aligns the causal mask bottom-right, so T < S (KV cache) just works;
    # it handles GQA natively when Hq is a multiple of Hkv.
    return flash_attn_func(q, k, v, causal=True)
