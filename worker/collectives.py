"""Collectives as the loop cannot see them: the gradient all-reduce inside backward, and the trace dump.

Two pieces the loop itself cannot set with a plain `liveness.doing(...)`:

- `GradientSync`: DDP all-reduces gradients inside `backward()`, so from the loop a
  rank waiting for a peer's gradients looks like one still computing. A hook on the
  first parameter (its gradient is produced last in backward) marks the moment this
  rank's own backward is done; from then until backward returns, it waits for the
  others: that is the collective wait the straggler check subtracts and the hang
  verdict reports ("waiting in all_reduce (gradients)").
- `dump_collective_trace`: PyTorch's flight recorder (on by default in torch 2.13, for
  gloo too) dumped on the supervisor's request: the full dump for torch's own analyser
  and a compact JSON the supervisor reads.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import torch

from gpuherd.files import write_bytes_atomic
from gpuherd.liveness import Liveness

GRADIENT_ALL_REDUCE = "all_reduce (gradients)"
SYNCING_STRATEGIES = ("ddp", "zero1")  # gradients all-reduced inside backward (DDP's reducer)
LAST_ENTRIES = 4  # per process group, in the compact trace: enough to see who never joined


class GradientSync:
    """Marks the gradient all-reduce wait of DDP-style strategies in the liveness whereabouts."""

    def __init__(self, model: torch.nn.Module, strategy: str, world_size: int, live: Liveness) -> None:
        self.live = live
        self._armed = False
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if strategy in SYNCING_STRATEGIES and world_size > 1 and first is not None:
            first.register_post_accumulate_grad_hook(self._local_backward_done)

    def _local_backward_done(self, _param: torch.Tensor) -> None:
        if self._armed:
            self.live.collective_begin(GRADIENT_ALL_REDUCE)

    @contextlib.contextmanager
    def micro_step(self, syncs: bool) -> Iterator[None]:
        """Around one micro-step's forward/backward; `syncs`: this one all-reduces (the last)."""
        self._armed = syncs
        try:
            yield
        finally:
            self._armed = False
            self.live.collective_end()


def _dump_fr() -> bytes | None:
    c10d = torch._C._distributed_c10d
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):  # the generic recorder, then the NCCL-only one
        dump = getattr(c10d, name, None)
        if dump is not None:
            # Without the call sites' Python frames: symbolising them imports sympy & co. lazily,
            # seconds of CPU during a hang; the SIGUSR1 stack dump that follows shows them anyway.
            return dump(includeCollectives=True, includeStackTraces=False)
    return None


def compact_trace(rank: int, dump: dict[str, Any]) -> dict[str, Any]:
    """What the supervisor needs of one rank's dump: per process group, how far it got
    and its last few collectives (no stack frames)."""
    last: dict[str, list[dict[str, Any]]] = {}
    for entry in dump.get("entries", []):
        last.setdefault(str(entry.get("pg_id")), []).append({
            "seq": entry.get("collective_seq_id"), "op": entry.get("profiling_name"),
            "state": entry.get("state"), "retired": entry.get("retired"),
            "group": list(entry.get("process_group") or ()),
        })
    return {"rank": rank, "pg_status": dump.get("pg_status", {}), "pg_config": dump.get("pg_config", {}),
            "last": {pg: entries[-LAST_ENTRIES:] for pg, entries in last.items()}}


def dump_collective_trace(trace_dir: Path) -> None:
    """`<trace_dir>/fr/rank<r>` (torch's format: `python -m torch.distributed.flight_recorder.fr_trace
    --prefix rank <trace_dir>/fr`) and `<trace_dir>/rank<r>.json` (compact, for the supervisor)."""
    raw = _dump_fr()
    if raw is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    (trace_dir / "fr").mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(trace_dir / "fr" / f"rank{rank}", raw)
    dump = pickle.loads(raw)  # torch's own bytes, produced just now in this process
    write_bytes_atomic(trace_dir / f"rank{rank}.json", orjson.dumps(compact_trace(rank, dump)))
