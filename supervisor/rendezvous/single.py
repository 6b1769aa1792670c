"""The single-node backend: a fresh rendezvous store on loopback per attempt; nothing to agree on."""

from __future__ import annotations

from supervisor.gpus import DevicePlan
from supervisor.rendezvous.api import OnCause, Setup
from supervisor.rendezvous.store import HostedStore
from supervisor.summary import RootCause


class SingleNode:
    def __init__(self) -> None:
        self.node_rank, self.nnodes = 0, 1
        self.nodes: list[dict] = []
        self.helper_pid: int | None = None  # no process lives across attempts

    def begin(self, attempt: int, plan: DevicePlan, resume: str | None) -> Setup:
        store = HostedStore()  # a fresh one per attempt: torch's env:// keys are not per-attempt
        return Setup(plan, store.addr, store.port, plan.world_size, resume, store)

    def publisher(self, attempt: int) -> OnCause | None:
        return None

    def watch(self, attempt: int, on_remote: OnCause) -> None:
        pass

    def unwatch(self) -> None:
        pass

    def fail_before_start(self, cause: RootCause) -> RootCause:
        return cause

    def settle(self, attempt: int, cause: RootCause | None, notes: list[str]) -> RootCause | None:
        return cause

    def close(self) -> None:
        pass
