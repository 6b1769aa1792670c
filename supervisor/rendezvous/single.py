"""The single-node backend: a fresh rendezvous store per attempt; nothing to agree on.

Where it listens follows torchrun's flags for one node (`SingleStore`): by default a free
loopback port the supervisor binds itself (two jobs never race for a port); with
`--master-addr`/`--master-port` exactly there; with `--standalone` a free port and
`MASTER_ADDR=localhost`, as torchrun's standalone rendezvous says.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from supervisor.gpus import DevicePlan
from supervisor.rendezvous.api import OnCause, OnRemote, Setup
from supervisor.rendezvous.store import MASTER_ADDR, HostedStore
from supervisor.summary import RootCause


@dataclass(frozen=True)
class SingleStore:
    bind_addr: str = MASTER_ADDR  # the interface the store listens on (a name is resolved)
    port: int = 0  # 0: a free port
    advertise: str = MASTER_ADDR  # what the workers get as MASTER_ADDR


class SingleNode:
    def __init__(self, spec: SingleStore | None = None, listen: socket.socket | None = None) -> None:
        """`listen`: a socket bound for `spec` before anything was written (a fixed port is then
        held for the whole job, every attempt's store serving from it)."""
        self.node_rank, self.nnodes, self.group_rank = 0, 1, 0
        self.nodes: list[dict] = []
        self.helper_pid: int | None = None  # no process lives across attempts
        self.spec = spec or SingleStore()
        self._listen = listen

    def begin(self, attempt: int, plan: DevicePlan, resume: str | None) -> Setup:
        # a fresh store per attempt: torch's env:// keys are not per-attempt
        store = HostedStore(listen=self._listen) if self._listen is not None else HostedStore()
        return Setup(plan, self.spec.advertise, store.port, plan.world_size, resume, store)

    def publisher(self, attempt: int) -> OnCause | None:
        return None

    def watch(self, attempt: int, on_remote: OnRemote) -> None:
        pass

    def unwatch(self) -> None:
        pass

    def regroup(self, attempt: int) -> None:
        return None

    def lines(self, receive) -> None:
        return None

    def mover(self, attempt, answer) -> None:
        return None

    def fail_before_start(self, cause: RootCause) -> RootCause:
        return cause

    def settle(self, attempt: int, cause: RootCause | None, notes: list[str]) -> RootCause | None:
        return cause

    def gather_outcomes(self, mine: dict) -> list[dict] | None:
        return [mine]

    def close(self) -> None:
        if self._listen is not None:
            self._listen.close()
