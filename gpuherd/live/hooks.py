"""What gpuherd puts in place in a script's process under live recovery, right after the script
imported torch (the script bootstrap's import hook calls `install`: the script's own order of
imports does not matter, and nothing of torch is imported before the script does), so before
the script makes its process group and its DDP wrapper.

- `torch.distributed.init_process_group`: the connections the group opened are noted (a survivor
  shuts down only those when it leaves a broken group: the script's other sockets stay open). In
  a warm spare taking a lost rank (GPUHERD_JOIN_GENERATION=g), the call joins the survivors'
  rebuilt group g instead (gpuherd/broken_group.py: `join_rebuilt`), with the rank and world size
  of the lost rank.
- `DistributedDataParallel.__init__`: its arguments are kept on the wrapper (a rebuilt group's
  wrapper is made with the same ones); in that spare, without the constructor's shape check and
  broadcast (no survivor makes them: the state comes from a survivor right after).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
import json
import os
from dataclasses import dataclass
from typing import Any

from gpuherd import contract

DEFAULT_TIMEOUT_S = 600.0  # the rebuilt group's rendezvous, when the run's config cannot be read


@dataclass
class Hooks:
    """What the patched calls saw, read by the session (gpuherd/live/session.py)."""

    generation: int = 0  # a newcomer: the rebuilt group it joined (0: an original rank)
    joined: bool = False  # the newcomer's init_process_group joined it
    # the connections the group opened (None: not seen, all but the store's are the group's)
    group_connections: set[tuple[Any, Any]] | None = None
    installed: bool = False
    init: Callable[..., None] | None = None  # torch's own init_process_group


HOOKS = Hooks()


def rendezvous_timeout() -> float:
    """system.rendezvous_timeout of the run (its config.json), as the trainer's rebuilt groups wait."""
    try:
        with open(os.environ[contract.CONFIG_PATH], encoding="utf-8") as f:  # noqa: PTH123
            return float(json.load(f)["system"]["rendezvous_timeout"])
    except (KeyError, OSError, ValueError, TypeError):
        return DEFAULT_TIMEOUT_S


def install() -> None:
    if HOOKS.installed:
        return
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gpuherd.broken_group import connections, join_rebuilt
    from gpuherd.live.ddp import INIT_ARGS

    HOOKS.installed = True
    HOOKS.generation = int(os.environ.get(contract.JOIN_GENERATION) or 0)
    original_init = HOOKS.init = dist.init_process_group

    @functools.wraps(original_init)
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        before = connections()
        if HOOKS.generation and not HOOKS.joined:
            backend = kwargs.get("backend", args[0] if args else None)
            device = kwargs.get("device_id")
            device = torch.device("cuda", device) if isinstance(device, int) else device
            join_rebuilt(backend, rendezvous_timeout(), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                         device or torch.device("cpu"), HOOKS.generation, init=original_init)
            HOOKS.joined = True
        else:
            original_init(*args, **kwargs)
        HOOKS.group_connections = connections() - before

    dist.init_process_group = init_process_group
    original_ddp = DistributedDataParallel.__init__

    @functools.wraps(original_ddp)
    def ddp_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        if HOOKS.joined:
            kwargs["init_sync"] = False  # a newcomer: the survivors make no broadcast to answer it
        original_ddp(self, module, *args, **kwargs)
        object.__setattr__(self, INIT_ARGS, (args, dict(kwargs)))

    DistributedDataParallel.__init__ = ddp_init
