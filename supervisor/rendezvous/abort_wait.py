"""Each node's wait on the job's abort key: in a store connection of its own, so that one round
trip after any node publishes a root cause this node has it, at no request while nothing happens.
The wait is asked in pieces (a server-side wait, renewed), spread so that N nodes that began at
one join never renew at once."""

from __future__ import annotations

from collections.abc import Callable

from supervisor.rendezvous.beat_watch import abort_key
from supervisor.rendezvous.store_calls import StoreCalls

ABORT_WAIT_S = 30.0  # the abort wait's pieces (two requests each: the wait, and its cancel when it ran out)
GOLDEN = 0.6180339887498949  # node r's first piece: consecutive ranks land far apart in the period


def renewal_offset(node_rank: int) -> float:
    """How long node r's first abort wait lasts: between ABORT_WAIT_S / 2 and 3 / 2 of it, spread
    evenly over the nodes (golden-ratio steps), so that the renewals of N waits that began at
    one join never reach the store at once (its cancel of a wait scans every waiter)."""
    return ABORT_WAIT_S * (0.5 + (node_rank * GOLDEN) % 1.0)


def wait(conn: StoreCalls, k: int, node_rank: int, over: Callable[[], bool],
         give_up: Callable[[], bool]) -> bytes | None:
    """Attempt k's root cause once a node published it; None once `over()` (reported already, the
    store lost) or, after a piece that ran out, `give_up()` (this node leaves, or joined a later attempt)."""
    piece = renewal_offset(node_rank)  # the first piece spreads every node's renewals over the period
    while not over():
        if conn.wait([abort_key(k)], piece):
            # The key exists now: compare_set with "" expected returns its value untouched, in one
            # round trip (torch's `get` is two: a wait, then the get), for every node at once.
            return conn.compare_set(abort_key(k), "", b"")
        if give_up():
            return None
        piece = ABORT_WAIT_S
    return None
