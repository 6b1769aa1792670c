"""Causal attention kernels behind one signature, and the choice between them.

All kernels take q [B, T, Hq, D] and k, v [B, S, Hkv, D] (flash-attn's layout,
so the fast path needs no transposes) and return [B, T, Hq, D]. `S >= T`: the
queries are the last T positions of the S keys (prefill with S == T in
training, one query over a KV cache during generation).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from gpuherd.config import ConfigError

BACKENDS = ("flash_attn", "sdpa", "eager")

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(requested: str, device_type: str, dtype: torch.dtype | None) -> tuple[str, str]:
    """(backend, reason). `dtype` is the compute dtype (autocast dtype or None = fp32).

    flash-attn kernels exist only for CUDA tensors in bf16/fp16; asking for it
    elsewhere is a config mistake, so it raises instead of silently degrading.
    """
    flash_ok = flash_attn_installed() and device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if requested == "auto":
        if flash_ok:
            return "flash_attn", "flash-attn installed, CUDA, half precision"
        why = ("flash-attn not installed" if not flash_attn_installed()
               else "not on CUDA" if device_type != "cuda" else "not in bf16/fp16")
        return "sdpa", f"torch scaled_dot_product_attention ({why})"
    if requested == "flash_attn" and not flash_ok:
        raise ConfigError(
            "model.attention=flash_attn needs the flash-attn package, a CUDA device and "
            "bf16/fp16 autocast (training.use_amp=true); use sdpa or auto instead"
        )
    if requested not in BACKENDS:
        raise ConfigError(f"unknown attention backend {requested!r}; choose from auto, {', '.join(BACKENDS)}")
    return requested, "requested in model.attention"


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
