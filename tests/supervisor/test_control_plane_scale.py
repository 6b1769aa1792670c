"""The multi-node control plane at 64 simulated nodes (bench/scale_sim.py: the real node agent per
node, its own store connections and threads, one real TCPStore server in its own process): the
store's load per node stays flat, one node's failure reaches every node, and a node whose
processes died is named on every survivor."""

from __future__ import annotations

import resource

import orjson
import psutil
import pytest

from bench.scale_sim import CLUSTER_SOFT_FILES, GpuherdJob, roomy, start_store_server
from supervisor.rendezvous.beat_watch import BEAT_S
from supervisor.rendezvous.node0_judge import CLOSED_GRACE_S
from supervisor.rendezvous.node_agent_main import Agent
from tests.supervisor.test_node_agent_data import DictStore

NODES = 64


@pytest.fixture(scope="module")
def job():
    roomy(0)
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
    assert named and took <= 3 * 2  # named within 3 s (not after the grace): slack for 2 busy cores
    survivors = [nd.first("abort", 1)[1]["cause"] for nd in job.nodes if nd.r != 3]
    assert all(c["stop_after_s"] == CLOSED_GRACE_S for c in survivors)  # their workers are stopped later


@pytest.mark.integration
def test_after_a_worker_failure_every_node_reads_a_verdict_of_a_few_dozen_bytes(job):
    """Every node's `alive` check at once, as after an ordinary worker failure: each answers that
    nobody is dead, from reads of node 0's verdict that stay a few dozen bytes (a node that stood
    still two reads adds its seq). The former verdict held a seq per node: ~550 bytes a read here,
    ~8 KB at 1,024 nodes, read about 5 times by every node."""
    job.join(2, timeout=30)
    job.abort_fanout(2)
    fan = job.verdict_fanout(2)
    assert fan["verdict_false"] == 0
    assert 0 < fan["verdict_bytes_per_node"] < 200 * fan["verdict_reads_per_node"]  # slack: ~19 stalled nodes


@pytest.mark.integration
def test_the_harness_runs_every_node_under_a_clusters_soft_file_limit(job):
    """The harness measures what a cluster meets: no process of it raises its open-file limit for
    the simulation's sake (64 nodes a shard need far fewer); node 0's shard and the store raise it
    only as node 0's supervisor would, for what N needs (64 nodes: within 1,024, so not at all)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    expected = CLUSTER_SOFT_FILES if hard == resource.RLIM_INFINITY else min(CLUSTER_SOFT_FILES, hard)
    procs = [job.server] + [shard.proc for shard in job.shards]
    assert [psutil.Process(p.pid).rlimit(psutil.RLIMIT_NOFILE)[0] for p in procs] == [expected] * len(procs)


@pytest.mark.integration
def test_the_harness_store_under_a_low_hard_file_limit_is_refused_with_node_0s_line():
    """1,024 nodes where the hard limit is 1,024: the store refuses in node 0's one line (how to
    raise the limit), as node 0's supervisor would, instead of being raised by the harness."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard open-file limit here is {hard}")
    with pytest.raises(RuntimeError, match=r"node 0 of 1024 nodes \(1 workers each\) needs about 5192 open files"):
        start_store_server(1024, hard_limit=1024)


def _agent(node_rank: int, values: dict[str, bytes]) -> tuple[Agent, list[dict]]:
    agent = Agent(DictStore(values), node_rank=node_rank, nnodes=3, join_timeout=1.0, where="10.0.0.1:29500")
    events: list[dict] = []
    agent.emit = lambda event, **fields: events.append({"event": event, **fields})
    return agent, events


def test_node_0_writes_every_record_as_one_value_once_all_are_in_and_each_node_reads_it():
    records = {f"a0/node{r}": orjson.dumps({"host": f"h{r}", "nproc": 8, "node": r}) for r in (1, 2)}
    agent, events = _agent(0, dict(records))
    agent.handle({"cmd": "join", "attempt": 0, "record": {"host": "h0", "nproc": 8, "node": 0}})
    assert [e["event"] for e in events] == ["joined"]
    assert [n["host"] for n in events[0]["nodes"]] == ["h0", "h1", "h2"]
    assert orjson.loads(agent.store.values["a0/nodes"]) == events[0]["nodes"]


def test_a_node_other_than_0_whose_record_comes_last_never_gathers():
    """Node 0 alone asks about every record key: the last node in waits for node 0's decision."""
    records = {f"a0/node{r}": orjson.dumps({"host": f"h{r}", "nproc": 8, "node": r}) for r in (0, 1)}
    agent, events = _agent(2, dict(records))
    agent.handle({"cmd": "join", "attempt": 0, "record": {"host": "h2", "nproc": 8, "node": 2}})
    assert "a0/nodes" not in agent.store.values and "a0/all" not in agent.store.values
    assert [e["event"] for e in events] == ["join-timeout"]  # node 0 (not running here) never decided


def test_an_alive_check_answers_at_once_when_node_0_names_a_dead_node():
    dead = {"kind": "node", "exit_code": 1, "node": 2, "message": "node 2 (h2) stopped responding"}
    agent, events = _agent(1, {"a0/verdict": orjson.dumps({"seq": 5, "floor": 5, "late": {}, "dead": [dead]})})
    agent.nodes.members = [0, 1, 2]
    agent.handle({"cmd": "alive", "attempt": 0})
    agent.poll()  # node 0's next readings are not waited for: the first dead node is the cause
    assert events == [{"event": "alive", "attempt": 0, "silent": [dead]}]


def test_abort_wait_renewals_of_a_thousand_nodes_never_arrive_at_once():
    """Every node starts its abort wait at the same join: renewing each after the same 30 s would
    bring N cancels to the store in one instant, each scanning every waiter. The first pieces
    spread them evenly over the period, so no second of it carries much more than its share."""
    from collections import Counter

    from supervisor.rendezvous.abort_wait import ABORT_WAIT_S, renewal_offset

    firsts = [renewal_offset(r) for r in range(1024)]
    assert all(ABORT_WAIT_S / 2 <= s < 1.5 * ABORT_WAIT_S for s in firsts)
    per_second = Counter(int(s) for s in firsts)
    share = 1024 / ABORT_WAIT_S
    assert len(per_second) == ABORT_WAIT_S and max(per_second.values()) <= 1.2 * share
