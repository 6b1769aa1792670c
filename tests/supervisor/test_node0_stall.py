"""Node 0's node agent SIGSTOPped (a frozen VM, an operator's Ctrl-Z, swap) for longer than the
other nodes wait for the job store: they give node 0 up, and node 0, running again, names its
own stall as the job's cause — never a healthy node whose connection closed because of it;
the other nodes say that node 0's job store stopped answering, which is what they saw. Real node
supervisors on this host, 3 nodes (not the issue's 8: the test shares 2 cores; what is under test
is node 0's view of its own stall, which the node count does not change)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.supervisor import helpers as sh
from tests.supervisor.test_multinode import _node, _port, _summary

NODES = 3


def _agent_of(supervisor_pid: int) -> psutil.Process:
    for child in psutil.Process(supervisor_pid).children(recursive=True):
        try:
            if "supervisor.rendezvous.node_agent_main" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no node agent under supervisor pid {supervisor_pid}")


@pytest.mark.slow
def test_node_0s_agent_stopped_12_s_names_node_0_on_every_node_and_no_healthy_node(tmp_path):
    port = _port()
    procs = [_node(tmp_path, r, port, *["forever"] * NODES, nnodes=NODES) for r in range(NODES)]
    with sh.none_left(procs):
        assert sh.wait_for(lambda: len(list((tmp_path / "logs").glob("job-node*/worker-rank*.log"))) == NODES,
                           timeout=90)
        time.sleep(2)  # a few beats into the attempt
        agent = _agent_of(procs[0].pid)
        os.kill(agent.pid, signal.SIGSTOP)
        time.sleep(12)
        os.kill(agent.pid, signal.SIGCONT)
        results = [sh.finish(p, timeout=90) for p in procs]
    for r, (code, _out, err) in enumerate(results):
        assert code == 1, (r, err[-3000:])
        rc = _summary(tmp_path, r)["root_cause"]
        assert rc["kind"] == "node" and rc["node"] == 0, (r, rc)  # every node names node 0, none another
        # each node says what it saw, in one line: node 0 its own stall; the others that node 0's
        # store stopped answering (they could not see why)
        said = "root cause: node 0 (" if r == 0 else \
            f"root cause: lost the job store at 127.0.0.1:{port}: node 0's job store stopped answering (no answer " \
            "for 10 s: node 0's machine or its node agent stopped, or the network to it; " \
            "system.node_silence_timeout rides out shorter stalls)\n"
        assert said in err, (r, err[-3000:])
        assert not any(f"node {other} (" in line and "stopped responding" in line
                       for line in err.splitlines() for other in range(1, NODES)), (r, err[-3000:])  # no healthy node
        if r == 0:  # node 0's stall is its own node's failure, not another's
            assert "the job failed on this node: node 0 (" in err and "failed on another node" not in err, err[-3000:]
    rc0 = _summary(tmp_path, 0)["root_cause"]["message"]
    assert "its node agent did not run for 1" in rc0 and "a consequence, not a cause" in rc0, rc0
