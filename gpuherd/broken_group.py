"""A process group a lost peer broke: what a collective raises then, how a rank leaves the group for
real, and how it joins the rebuilt one. Shared by the built-in trainer's live recovery
(worker/live_recovery.py) and a script's (gpuherd/live.py), which must import nothing outside
`gpuherd` (a user package named `worker` would be found first on a script's sys.path).

The rebuilt group meets on the same store (the supervisor's, MASTER_ADDR:MASTER_PORT) under a
prefix of its own, `gpuherd-live/<generation>`, so no key of an earlier group is read back.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

# Collectives after the rendezvous may legitimately take long (a large checkpoint
# written by one rank while the others wait); real hangs are the supervisor's job.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)

# What a collective raises on a rank whose peer died: gloo's closed or reset connection, the
# store's lost socket, NCCL's aborted communicator. Anything else is this rank's own failure.
PEER_LOSS_WORDS = ("connection closed by peer", "connection reset by peer", "connection was likely closed",
                   "broken pipe", "communicator was aborted", "nccl communicator", "remote worker crashing")


def is_peer_loss(exc: BaseException) -> bool:
    if isinstance(exc, (dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in PEER_LOSS_WORDS)


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def job_store(timeout: timedelta) -> Any:
    """A client of the attempt's store (MASTER_ADDR:MASTER_PORT), which the supervisor serves."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                         timeout=timeout, wait_for_workers=False)


def join_rebuilt(backend: str | None, timeout_s: float, rank: int, world_size: int, device: torch.device,
                 generation: int, init: Callable[..., None] | None = None) -> None:
    """Form rebuilt group `generation` as the default group: `rank` of `world_size` (a spare takes
    the lost rank), then a barrier (every rank has really joined). Raises what torch raises when
    it does not form within `timeout_s`. `init`: torch's init_process_group (gpuherd.live wraps
    the module's own)."""
    timeout = timedelta(seconds=timeout_s)
    store = job_store(timeout)
    # eager NCCL init only: gloo on a CUDA device (ranks sharing one GPU for tests) takes no device_id
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" and backend == "nccl" else {}
    (init or dist.init_process_group)(backend, store=dist.PrefixStore(f"gpuherd-live/{generation}", store),
                                      rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    dist.barrier()
    if hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        dist.distributed_c10d._set_pg_timeout(COLLECTIVE_TIMEOUT)


def leave_broken_group(only: set[tuple[Any, Any]] | None = None) -> None:
    """Drop a process group a lost peer broke. Its connections to the peers are shut down first
    (`sever_peer_connections`); NCCL: the communicators are aborted too, so nothing waits for the
    collective timeout on a peer that is gone. `only`: as for `sever_peer_connections`."""
    if not active():
        return
    sever_peer_connections(only)
    try:
        if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except RuntimeError:
        pass  # a group that cannot even be torn down cleanly is dropped all the same
    if active():
        dist.distributed_c10d._world.default_pg = None


def sever_peer_connections(only: set[tuple[Any, Any]] | None = None) -> int:
    """Shut down every TCP connection of this process to its peers (all but the store's, at
    MASTER_PORT); returns how many. A gloo collective waits on one peer only, so with more than
    two ranks a survivor can wait on another survivor rather than on the lost rank, and gloo gives
    it no error: it is freed only when that survivor's connection closes. Destroying or aborting
    a gloo group does not close them while anything (DDP, a vote, a writer's group) still holds
    it, and its destructor would wait for its own blocked threads; a socket shut down here fails
    those threads' operations at once, on this rank and at every peer it served. `only`: the
    (local, remote) addresses of the connections to shut down (`connections()` around the group's
    creation: a script's own connections, to a local W&B service say, stay open); None: all."""
    store_port = int(os.environ.get("MASTER_PORT") or 0)
    severed = 0
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.status != psutil.CONN_ESTABLISHED or conn.fd < 0 or not conn.raddr:
            continue
        if store_port in (conn.raddr.port, conn.laddr.port):  # the store's, from either end
            continue
        if only is not None and (tuple(conn.laddr), tuple(conn.raddr)) not in only:
            continue
        try:
            with socket.socket(fileno=os.dup(conn.fd)) as sock:  # the duplicate shares the connection
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            continue  # closed meanwhile
        severed += 1
    return severed


def connections() -> set[tuple[Any, Any]]:
    """This process's established TCP connections, as (local, remote) addresses: taken before and
    after a group forms, the difference is the group's (`sever_peer_connections(only=...)`)."""
    return {(tuple(c.laddr), tuple(c.raddr)) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_ESTABLISHED and c.raddr}
