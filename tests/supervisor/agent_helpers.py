"""Node agents in the test's own process, on a real TCPStore: what the spare-node and move-out
tests share (an agent whose events are collected, spare nodes that poll quickly)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from supervisor.rendezvous import spare_node_agent
from supervisor.rendezvous.node_agent_main import Agent


@pytest.fixture
def quick_spares(monkeypatch):
    """Spare nodes poll every 50 ms; their threads are joined at the end (the test sets `closed`)."""
    monkeypatch.setattr(spare_node_agent, "POLL_S", 0.05)
    yield
    for thread in threading.enumerate():
        if thread.name == "spare-node":
            thread.join(timeout=5)


def in_process_agent(port: int, node: int, nnodes: int) -> tuple[Agent, list[dict]]:
    """Node `node`'s agent on the store at `port`, and the list its events go to (as dicts)."""
    connect = lambda: TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))  # noqa: E731
    agent = Agent(connect(), node_rank=node, nnodes=nnodes, join_timeout=5.0, where=f"127.0.0.1:{port}")
    agent.connect = connect
    events: list[dict] = []
    agent.emit = lambda event, events=events, **fields: events.append({"event": event, **fields})
    return agent, events
