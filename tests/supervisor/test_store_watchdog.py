"""A node other than 0 gives node 0 up when its job store answers nothing for
system.node_silence_timeout (supervisor/rendezvous/store_watchdog.py), counted in time the node
itself ran: its own stall (SIGSTOP, a suspended VM, found by own_lag.py's ticker, the one
detector of stalls) is never node 0's silence. What it says is what it saw, in one line."""

from __future__ import annotations

import time

from supervisor.rendezvous.own_lag import STALL_S, OwnLag
from supervisor.rendezvous.store_calls import TimedStore
from supervisor.rendezvous.store_watchdog import store_silence, store_silent, watch_store


def _waiting_since(seconds_ago: float) -> TimedStore:
    """A connection whose call has waited for node 0's answer since `seconds_ago` (it was due then)."""
    timed = TimedStore(object())
    timed.due = time.monotonic() - seconds_ago
    return timed


def test_a_call_unanswered_past_the_allowance_gives_node_0_up_and_says_so_in_one_line():
    timed = _waiting_since(5.0)
    lag = OwnLag(start=False)
    assert store_silent([timed], 4.0, lag) and not store_silent([timed], 6.0, lag)  # the allowance decides
    watch_store([timed], 4.0, lag, lambda: False, every=0.01)  # returns: the caller says the line and ends
    said = store_silence("10.0.0.1:29500", 4.0)
    assert said == ("lost the job store at 10.0.0.1:29500: node 0's job store stopped answering (no answer for 4 s: "
                    "node 0's machine or its node agent stopped, or the network to it; "
                    "system.node_silence_timeout rides out shorter stalls)")
    assert "\n" not in said


def test_no_verdict_while_no_call_waits():
    assert not store_silent([TimedStore(object())], 4.0, OwnLag(start=False))  # no call in flight


def test_this_nodes_own_stall_is_not_node_0s_silence():
    """This node's agent stood still 20 s (its ticker's last tick was 20 s ago) while a call waited
    100 s: the call's silence counts from when it ran again, so node 0 is not given up for this
    node's own stall; a gap below STALL_S (a busy host's late tick) is no stall."""
    timed = _waiting_since(100.0)
    lag = OwnLag(start=False)
    lag._last -= 20.0  # the ticker last ran 20 s ago: this process stood still since
    assert not store_silent([timed], 10.0, lag)
    assert lag.stalls and lag.thawed_at() > timed.due
    late = OwnLag(start=False)
    late._last -= STALL_S / 2
    assert late.thawed_at() == float("-inf") and store_silent([timed], 10.0, late)
