"""A spare node's warm workers (--spare-nodes): while the node stands by without a rank, one
warm spare per local device imports torch and the trainer, opens the dataset cache and
rehearses the first step (worker/spare.py), as a node's --spares do. When node 0 hands the
node a dead node's place, each takes the rank of a local slot (its assignment on stdin, the
same hand-over as a spare promoted on its own node), so the newcomers of the rebuilt group
pay none of that after the death; one that died meanwhile is replaced by a fresh worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from loguru import logger

from supervisor.gpus import DeviceSlot
from supervisor.processes.live_setup import AttemptLive, discard_spares
from supervisor.processes.spares import SparePool
from supervisor.processes.spawn import WorkerProcess


class SpareNodeWorkers:
    def __init__(self, live: AttemptLive) -> None:
        """`live`: the spare's start (its environment before it has a rank: the config and the
        dataset cache are all its warm-up reads)."""
        self.pool = SparePool(len(live.plan.slots), live.start_spare)

    def start(self) -> list[WorkerProcess]:
        return self.pool.fill()

    def take(self, slot: DeviceSlot, env: Mapping[str, str], log_path: Path) -> WorkerProcess | None:
        """A warm spare become `slot`'s rank with `env`, or None (none left alive: start one afresh)."""
        spare, why = self.pool.take()
        if spare is None:
            logger.warning(f"rank {slot.rank}: {why}; it starts a fresh worker")
            return None
        try:
            return self.pool.promote(spare, slot, log_path, env)
        except OSError as exc:  # it died just now
            logger.warning(f"rank {slot.rank}: the warm spare pid {spare.pid} is gone ({exc}); it starts a fresh worker")
            spare.discard()
            return None

    def discard(self, forget: Callable[[int], None]) -> None:
        """Spares no rank took (the job ended without this node): ended, nothing of them left."""
        discard_spares(self.pool, forget)
