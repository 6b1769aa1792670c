"""A node other than 0 gives node 0 up when its job store stops answering.

Each of the node's store connections says until when its answer is due (store_calls.py
`TimedStore`); a call unanswered `silent_s` (system.node_silence_timeout) past that means node
0's job store stopped answering: its machine or its node agent stopped, or the network to it
(a partition sends no RST, so the call would otherwise just wait). The node says so in one
line, which is what it saw: node 0's own agent names the stall when it runs again.

The silence is counted in time this process ran: after a stall of its own (SIGSTOP, a
suspended VM: the gaps own_lag.py finds in its ticker's ticks, the one detector of them), the
silence counts from when it ran again, never the time it stood still itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from supervisor.rendezvous.beat_watch import BEAT_S
from supervisor.rendezvous.own_lag import OwnLag
from supervisor.rendezvous.store_calls import TimedStore, overdue


def store_silence(where: str, silent_s: float) -> str:
    """The line a node says when node 0's job store at `where` answered nothing for `silent_s`."""
    return (f"lost the job store at {where}: node 0's job store stopped answering (no answer for {silent_s:g} s: "
            "node 0's machine or its node agent stopped, or the network to it; system.node_silence_timeout "
            "rides out shorter stalls)")


def watch_store(timed: list[TimedStore], silent_s: float, lag: OwnLag, lost: Callable[[], bool],
                every: float = BEAT_S) -> None:
    """Returns once one of `timed` waits for an answer `silent_s` past its due time (and past this
    process's last stall) while `lost()` is False (the agent has not said its store is gone
    already); the caller then says `store_silence` and ends the agent."""
    while True:
        time.sleep(every)
        if store_silent(timed, silent_s, lag) and not lost():
            return


def store_silent(timed: list[TimedStore], silent_s: float, lag: OwnLag) -> bool:
    """Whether a call waits for its answer `silent_s` past its due time, counted in time this
    process ran (from the end of its last stall, when later)."""
    return overdue(timed, silent_s, since=lag.thawed_at())
