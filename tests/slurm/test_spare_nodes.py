"""A spare node under real SLURM (tests/slurm/cluster.py, 3 nodes): `gpuherd sbatch --nodes 2
--spare-nodes 1` allocates a third node that stands by; node 1's whole process tree (its
supervisor, node agent, orphan guard, worker and warm spare) is SIGKILLed, as a machine that
died: the spare node's warm worker takes rank 1, node 0's worker keeps its process, nobody
restarts, every loss equals an uninterrupted job's, and nothing is left running on any node.

Opt-in and slow (tests/slurm/conftest.py): GPUHERD_SLURM_TESTS=1 pytest -m slurm -n 0 tests/slurm
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.slurm.cluster import Cluster
from tests.slurm.test_jobs import STEPS, _workers, submit, uninterrupted  # noqa: F401 - a fixture

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

CLUSTER_NODES = 3  # two training nodes and a spare node


def _tree(cluster: Cluster, node: str, root: int) -> list[int]:
    """`root` and every process below it on `node` (its children by /proc's parent pids)."""
    parents = {}
    for pid in cluster.processes(node):
        try:
            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        grew = bool(below)
        tree |= below
    return sorted(tree)


def test_a_node_that_dies_whole_is_replaced_by_the_spare_node(cluster: Cluster, workdir: Path,
                                                              uninterrupted):  # noqa: F811 - the fixture
    job = submit(cluster, workdir, "--max-restarts", "1", steps=STEPS, spare_nodes=1)
    job.wait_step(2)
    (survivor,), _ = _workers(cluster, cluster.names[0])
    _, (warm,) = _workers(cluster, cluster.names[2])  # the spare node's warm worker, standing by
    cluster.on(cluster.names[1], "kill", "-9", *map(str, _tree(cluster, cluster.names[1],
                                                               job.supervisor_pid(cluster.names[1]))))
    job.wait_done(timeout=400)  # and nothing left on any node
    for node in (0, 2):
        summary = job.summary(node)
        assert summary["restarts"] == 0 and summary["exit_code"] == 0 and len(summary["attempts"]) == 1, node
        (rec,) = summary["recoveries"]
        assert (rec["outcome"], rec["action"], rec["node"], rec["rank"], rec["spare_node"]) == \
            ("recovered", "spare-node", 1, 1, 2), rec
    assert rec["steps_redone"] is not None and job.summary(0)["recoveries"][0]["steps_redone"] <= 1
    assert job.summary(0)["workers"][0]["pid"] == survivor  # node 0's worker kept its process
    assert job.summary(2)["workers"][0]["pid"] == warm  # the spare node's warm worker took rank 1
    got, expected = job.steps(), uninterrupted.steps()
    assert len(got) == STEPS and got == expected  # bit for bit, every step
