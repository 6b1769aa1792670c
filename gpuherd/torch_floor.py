"""The oldest torch the built-in trainer runs on, checked before anything starts.

Each API below is what sets the floor (first release that has it):

| API | where | torch |
|---|---|---|
| `torch.distributed.tensor` public (`DTensor`, `distribute_tensor`) | worker/model.py | 2.5 |
| `scaled_dot_product_attention(enable_gqa=...)` | worker/attention.py | 2.5 |
| `fully_shard` / `MixedPrecisionPolicy` in `torch.distributed.fsdp` | worker/engines/fsdp.py | 2.6 |
| `nn.utils.get_total_norm`, `clip_grads_with_norm_` | worker/engines/torch_engine.py | 2.6 |
| `distribute_tensor(..., src_data_rank=None)` | worker/model.py | 2.7 |

An older torch fails at init or at step 0 with an AttributeError or TypeError deep
in a stack; this module turns that into one line and exit 2. It imports nothing
but the standard library: the supervisor (which never imports torch) and
install.sh (before the requirements exist) use it too.
"""

from __future__ import annotations

import importlib.metadata
import re

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode

TORCH_FLOOR = (2, 7)
FLOOR_TEXT = ".".join(map(str, TORCH_FLOOR))
WHY = "distribute_tensor(src_data_rank=None) from 2.7; fully_shard, get_total_norm from 2.6"


class TorchTooOld(GpuherdError):
    exit_code = ExitCode.USAGE


def parse_version(version: str) -> tuple[int, int] | None:
    """(major, minor) of `2.6.0+cu124`, `2.7.0a0+git1234` or `2.13.0`; None if unreadable."""
    found = re.match(r"\s*(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def check_torch_version(version: str | None) -> None:
    """Raise TorchTooOld (one line, exit 2) when `version` is below the floor or missing."""
    if version is None:
        raise TorchTooOld(f"torch is not installed; gpuherd's trainer needs torch >= {FLOOR_TEXT} (bash install.sh)")
    parsed = parse_version(version)
    if parsed is not None and parsed < TORCH_FLOOR:
        raise TorchTooOld(f"torch {version} is too old: gpuherd's trainer needs torch >= {FLOOR_TEXT} ({WHY}); "
                          f"upgrade it (bash install.sh replaces it) or use a newer image")


def installed_torch_version() -> str | None:
    """The installed torch's version without importing torch (seconds saved in the supervisor)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":  # install.sh: `python -m gpuherd.torch_floor [VERSION]`: exit 1 and say why if too old
    import sys

    try:
        check_torch_version(sys.argv[1] if len(sys.argv) > 1 else installed_torch_version())
    except TorchTooOld as exc:
        print(exc)
        sys.exit(1)
