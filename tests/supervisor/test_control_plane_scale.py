"""The multi-node control plane at 64 simulated nodes (bench/scale_sim.py: the real node agent per
node, its own store connections and threads, one real TCPStore server in its own process): the
store's load per node stays flat, one node's failure reaches every node, and a node whose
processes died is named on every survivor."""

from __future__ import annotations

import pytest

from bench.scale_sim import GpuherdJob, roomy
from supervisor.rendezvous.beat_watch import BEAT_S
from supervisor.rendezvous.node_agent_main import CLOSED_GRACE_S

NODES = 64


@pytest.fixture(scope="module")
def job():
    roomy()
    job = GpuherdJob(NODES)
    yield job
    job.close()


@pytest.mark.integration
def test_64_nodes_join_beat_abort_and_name_a_dead_node(job):
    assert job.join(0, timeout=30) < 10
    per_node, false_verdicts = job.steady(4 * BEAT_S)
    assert per_node <= 2.0 and false_verdicts == 0  # about one beat per node per second, whatever N is
    assert job.abort_fanout(0) <= 0.2 * 5  # 200 ms promised; slack for 2 busy cores
    every = [nd.first("abort", 0)[1]["cause"]["node"] for nd in job.nodes]
    assert every == [NODES - 1] * NODES  # the same root cause on every node
    job.join(1, timeout=30)
    took, named = job.kill(1, victim=3, close_sockets=True)
    assert named and took <= CLOSED_GRACE_S + 3
