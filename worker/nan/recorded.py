"""A recorded suspicious step, found and loaded for an offline replay.

What a replay needs is written at a stopping step: `nan_grad_step_N.pt` (a file, or
an FSDP directory; read as generate.py reads checkpoints) holds the weights the step
started from (it is saved before the optimizer step), and each
`debug/nan_debug_step_N[_rankR].pkl` holds one rank's batch (input and target ids).
Given either, the other is found beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gpuherd.errors import GpuherdError
from gpuherd.exit_codes import ExitCode
from worker.checkpoint_io import FORMAT_DEEPSPEED, read_meta
from worker.distributed import WorkerError
from worker.inference import model_from_checkpoint
from worker.nan.dump import UntrustedPickle
from worker.nan.dump import load as load_dump

_CHECKPOINT = re.compile(r"^nan_grad_step_(\d+)\.pt$")
_RANK = re.compile(r"_rank(\d+)\.pkl$")
_DUMP = re.compile(r"^nan_debug_step_(\d+)(?:_rank\d+)?\.pkl$")


class ReplayError(GpuherdError):
    exit_code = ExitCode.USAGE


@dataclass
class Recorded:
    step: int
    checkpoint: Path
    dump_paths: list[Path]  # every rank's pickle of the step, in rank order

    def dumps(self) -> list[tuple[Path, dict[str, Any]]]:
        """Each rank's pickle, read as plain data only (an untrusted file is refused by name)."""
        return [(path, _read(path)) for path in self.dump_paths]


def locate(path: Path) -> Recorded:
    """The checkpoint and every rank's pickle of the step `path` (either of them) belongs to.
    Nothing is unpickled here when the file name says the step: the checkpoint is checked
    first, and a dump is only read once there is something to replay it on."""
    if not path.exists():
        raise ReplayError(f"{path} does not exist")
    if path.suffix == ".pkl":
        named = _DUMP.match(path.name)
        step = int(named.group(1)) if named else int(_read(path).get("step", -1))
        debug_dir, checkpoint = path.parent, path.parent.parent / f"nan_grad_step_{step}.pt"
    else:
        match = _CHECKPOINT.match(path.name)
        if not match:
            raise ReplayError(f"{path} is neither a nan_grad_step_N.pt checkpoint nor a nan_debug_step_N*.pkl dump")
        step, debug_dir, checkpoint = int(match.group(1)), path.parent / "debug", path
    if not checkpoint.exists():
        raise ReplayError(f"no checkpoint {checkpoint} for step {step}: only a step that stopped the run writes"
                          " one (a skipped step does not), and the replay starts from its weights")
    files = [debug_dir / f"nan_debug_step_{step}.pkl"] if (debug_dir / f"nan_debug_step_{step}.pkl").is_file() else []
    files += sorted(debug_dir.glob(f"nan_debug_step_{step}_rank*.pkl"), key=lambda p: int(_RANK.search(p.name)[1]))
    if not files:
        raise ReplayError(f"no debug pickle for step {step} in {debug_dir}: it holds the batch to replay")
    return Recorded(step, checkpoint, files)


def _read(path: Path) -> dict[str, Any]:
    try:
        return load_dump(path)
    except UntrustedPickle as exc:
        raise ReplayError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - unpickling fails in many types; all mean "not a dump"
        raise ReplayError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def load_model(checkpoint: Path, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The Transformer with the checkpoint's weights on `device`, and the checkpoint's meta."""
    try:
        meta = read_meta(checkpoint)
        if checkpoint.is_dir() and meta.get("format") == FORMAT_DEEPSPEED:
            raise ReplayError(f"{checkpoint} is a DeepSpeed checkpoint: DeepSpeed's step is judged after its"
                              " optimizer step, so the weights the step started from are gone")
        if "model_args" not in meta:
            raise ReplayError(f"{checkpoint} is not a gpuherd training checkpoint (no model description)")
        return model_from_checkpoint(checkpoint, meta).to(device), meta
    except WorkerError as exc:
        raise ReplayError(str(exc)) from None
