"""Clean parameter/module names and local tensors, whatever wraps the model.

The report must name parameters as the model declares them (`tok_embed.weight`,
`layers.0.attention.wq.weight`) even though the worker hands us a model
wrapped by DDP (`module.`), torch.compile (`_orig_mod.`), FSDP1
(`_fsdp_wrapped_module.`) or activation checkpointing
(`_checkpoint_wrapped_module.`). FSDP2 keeps names but turns parameters into
DTensors whose `.to_local()` is this rank's shard.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Path components that wrappers insert; none of them is a real layer name.
WRAPPER_COMPONENTS = frozenset({
    "module",  # DistributedDataParallel / DataParallel
    "_orig_mod",  # torch.compile's OptimizedModule
    "_fsdp_wrapped_module",  # FSDP1
    "_checkpoint_wrapped_module",  # torch.distributed.algorithms checkpoint_wrapper
    "_forward_module",  # Lightning / DeepSpeed style forward wrappers
})
ROOT_NAME = "<model>"


def clean_name(name: str) -> str:
    """`module._orig_mod.layers.0.attention.wq.weight` -> `layers.0.attention.wq.weight`.

    Only whole components are dropped, so a real submodule called `modules`
    or `module_norm` keeps its name."""
    parts = [p for p in name.split(".") if p and p not in WRAPPER_COMPONENTS]
    return ".".join(parts) if parts else ROOT_NAME


def is_dtensor(tensor: torch.Tensor) -> bool:
    """FSDP2 / tensor-parallel parameters; checked by duck typing so that a
    torch without torch.distributed.tensor still imports this module."""
    return hasattr(tensor, "to_local") and hasattr(tensor, "placements")


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: the shard of a DTensor, else the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(clean name, parameter) once per parameter; tied weights appear once,
    under their first name, as `named_parameters` already does."""
    seen: set[str] = set()
    for raw, param in model.named_parameters():
        name = clean_name(raw)
        if name in seen:  # two wrappers exposing the same parameter under two paths
            continue
        seen.add(name)
        yield name, param


def named_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(clean name, module) for every module, skipping pure wrappers (their
    output is the wrapped module's output, so they would only repeat it)."""
    seen: set[int] = set()
    for raw, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        if _is_wrapper(module):
            continue
        yield clean_name(raw), module


WRAPPER_TYPES = frozenset({"DistributedDataParallel", "DataParallel", "OptimizedModule",
                           "FullyShardedDataParallel", "CheckpointWrapper"})


def _is_wrapper(module: torch.nn.Module) -> bool:
    """A module that only forwards to one wrapped module (by type name, so no
    optional import is needed). FSDP2's `fully_shard` keeps the module itself."""
    return type(module).__name__ in WRAPPER_TYPES
