"""The supervision shell (supervisor/processes/supervision.py) without a worker: the root cause
is published off the loop (under SLURM that asks `scontrol`, which may take seconds), its answer
comes back as an event, and the time is the injected clock's."""

from __future__ import annotations

import signal
import threading
from dataclasses import replace
from types import SimpleNamespace

from supervisor.processes import announcing
from supervisor.processes import policy as pol
from supervisor.processes.stopping import StopRules
from supervisor.processes.supervision import Supervision

NAMED = "stopped by SLURM: scancel (SIGTERM)"


def _shell(on_cause, now: float = 100.0) -> Supervision:
    heartbeats = SimpleNamespace(ranks={}, longest_step=lambda: None)
    metrics = SimpleNamespace(write_lines=lambda data: None, write=lambda record: None)
    return Supervision([], SimpleNamespace(logs={}), heartbeats, metrics, StopRules.for_script(2.0, 10.0),
                       finish_window=60.0, on_cause=on_cause, clock=lambda: now)


def test_publishing_the_cause_never_holds_the_loop_and_its_answer_becomes_the_cause():
    asked, answer = threading.Event(), threading.Event()

    def slow_slurm(cause):  # what attempt_run.py's announcer does under SLURM: scontrol, then the name
        asked.set()
        answer.wait(30)
        return replace(cause, message=NAMED)

    sup = _shell(slow_slurm)
    try:
        sup._decide(pol.SignalReceived(sup._view(sup._clock()), signal.SIGTERM))
        assert asked.wait(10)
        # the decision is made and the loop is free while SLURM has not answered
        assert sup.cause.message == "the supervisor received SIGTERM" and sup.state.failed_at == 100.0
        answer.set()
        sup._await_announcements()
        assert sup.cause.message == NAMED and sup.cause.kind == "terminated"
    finally:
        answer.set()
        sup.restore_signal_handlers()


def test_a_publisher_that_fails_leaves_the_cause_as_this_node_saw_it():
    def broken(cause):
        raise OSError("the node agent is gone")

    sup = _shell(broken)
    try:
        sup._decide(pol.SignalReceived(sup._view(sup._clock()), signal.SIGTERM))
        sup._await_announcements()
        assert sup.cause.message == "the supervisor received SIGTERM"
    finally:
        sup.restore_signal_handlers()


def test_an_answer_later_than_the_wait_is_dropped(monkeypatch):
    monkeypatch.setattr(announcing, "ANNOUNCE_WAIT", 0.2)
    answer, answered = threading.Event(), threading.Event()

    def hung_slurm(cause):
        answer.wait(30)
        answered.set()
        return replace(cause, message=NAMED)

    sup = _shell(hung_slurm)
    try:
        sup._decide(pol.SignalReceived(sup._view(sup._clock()), signal.SIGTERM))
        sup._await_announcements()  # gives up after ANNOUNCE_WAIT: the cause stands as this node saw it
        assert sup.cause.message == "the supervisor received SIGTERM"
    finally:
        sup.restore_signal_handlers()  # the wake-up pipe is closed: the late answer must not write to it
    answer.set()
    assert answered.wait(10)
    sup.announcer.threads[0].join(10)
    assert sup.cause.message == "the supervisor received SIGTERM" and sup.announcer.published.empty()
