"""Where a script stands between two steps: its step, the position object it handed over (a
dict of generators, state-dict holders and plain values) and every global RNG, captured and
put back. What a survivor rewinds to and what a newcomer takes from the source."""

from __future__ import annotations

import copy
import hashlib
import pickle
from typing import Any

import torch

from gpuherd import rng


def capture_position(position: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `position`'s state: a torch.Generator's state, `state_dict()` of what has one, a
    deep copy of anything else."""
    out: dict[str, Any] = {}
    for key, value in (position or {}).items():
        if isinstance(value, torch.Generator):
            out[key] = value.get_state()
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            out[key] = copy.deepcopy(value.state_dict())
        else:
            out[key] = copy.deepcopy(value)
    return out


def restore_position(position: dict[str, Any] | None, state: dict[str, Any]) -> None:
    """`state` (from `capture_position`) back into `position`, in place: the script's own objects
    (its generator, its sampler) hold it, and a plain value is replaced in the dict."""
    if position is None:
        return
    for key, saved in state.items():
        value = position.get(key)
        if isinstance(value, torch.Generator):
            value.set_state(saved)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            value.load_state_dict(copy.deepcopy(saved))
        else:
            position[key] = copy.deepcopy(saved)


def capture(position: dict[str, Any] | None, device: torch.device) -> dict[str, Any]:
    """The position and every global RNG (Python's, numpy's where imported, torch's, the device's)."""
    return {"position": capture_position(position), "rng": rng.capture(device)}


def restore(position: dict[str, Any] | None, mark: dict[str, Any], device: torch.device,
            shared: set[str] | None = None) -> None:
    """`mark` back in place. `shared`: the RNGs to take from it (those every rank had alike at
    attach); the others keep this process's own state. None: all of them."""
    restore_position(position, mark["position"])
    own = rng.capture(device)
    rng.restore({name: (state if shared is None or name in shared else own[name])
                 for name, state in mark["rng"].items() if name in own}, device)


# What must be the same on every rank for a newcomer to take a survivor's: the script's position
# and torch's generators (the model's dropout, torch.randint's draws). Python's and numpy's are
# often never seeded (each process then has its own): those a newcomer keeps its own of.
MUST_BE_SHARED = ("position", "torch", "cuda")


def fingerprints(mark: dict[str, Any]) -> dict[str, str]:
    """Per part of a mark (the position, each RNG), a fingerprint: which parts every rank has alike."""
    return {"position": _digest(mark["position"]), **{name: _digest(state) for name, state in mark["rng"].items()}}


def _digest(mark: Any) -> str:
    def plain(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return bytes(obj.detach().cpu().contiguous().view(-1).view(torch.uint8).tolist())
        if isinstance(obj, dict):
            return sorted((str(k), plain(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return [plain(v) for v in obj]
        return obj
    return hashlib.sha256(pickle.dumps(plain(mark))).hexdigest()
