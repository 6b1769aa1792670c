"""Live recovery across nodes: supervisors on localhost run one job (`--nnodes N`, CPU workers,
gloo); a rank of node 1 is SIGKILLed mid-run. Node 1 claims the rebuilt group on the job
store and promotes its own warm spare; every other node's workers keep their processes,
rebuild the group with the newcomer and take the state by broadcast; nobody restarts, at
most one step is redone, and every loss equals an uninterrupted run's, bit for bit.

With a spare node (`--spare-nodes 1`), node 2 dies whole (its supervisor, agent and ranks
SIGKILLed at once): the spare node takes its ranks, the same way."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import sys

import orjson
import psutil
import pytest

from tests.e2e.helpers import next_spare, records
from tests.supervisor.helpers import finish, wait_for
from tests.worker.helpers import free_port
from tests.shared_runs import once_per_session

STEPS = 20
TINY = ["data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
        "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
        "training.grad_accum_nums=1", f"training.max_steps={STEPS}", "training.warmup_steps=5",
        "training.log_every=1", "training.eval_every=0", "training.save_every=0"]


def _uninterrupted(tmp_path, python_env, world_size: int, *extra: str) -> dict[tuple[int, int], float]:
    """The same model and data on one node with as many ranks (the same global ranks, the same gloo
    reduction over localhost): the losses a job across nodes has when nothing goes wrong."""
    cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--nproc",
           str(world_size), "--run-id", "plain", *extra]
    for item in TINY:
        cmd += ["--set", item]
    run = subprocess.run(cmd, cwd=tmp_path, env=python_env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = {(r["rank"], r["step"]): r["loss"] for r in records(tmp_path / "logs" / "plain", "step") if "loss" in r}
    assert len(losses) == world_size * STEPS
    return losses


def _shared_uninterrupted(tmp_path_factory, python_env, world_size: int) -> dict[tuple[int, int], float]:
    """`_uninterrupted` made once per session for each world size: the 3-node tests here both
    compare against the same 3-rank run (about 13 CPU s each time it is made)."""
    def make(cwd):
        _uninterrupted(cwd, python_env, world_size)
        return cwd / "logs" / "plain"

    plain = once_per_session(tmp_path_factory, f"multinode-uninterrupted-{world_size}-ranks", make)
    return {(r["rank"], r["step"]): r["loss"] for r in records(plain, "step") if "loss" in r}


def _start(tmp_path, python_env, run_id: str, nnodes: int, *extra: str, spare_nodes: int = 0) -> list[subprocess.Popen]:
    """Node 0 first; `spare_nodes` more (--node-rank nnodes...) stand by without a rank."""
    port = free_port()
    procs = []
    if spare_nodes:
        extra = (*extra, "--spare-nodes", str(spare_nodes))
    for node in range(nnodes + spare_nodes):
        cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--nproc", "1",
               "--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "--run-id", run_id, *extra]
        for item in TINY:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _run_dir(tmp_path, run_id: str, node: int):
    return tmp_path / "logs" / f"{run_id}-node{node}"


def _losses(tmp_path, run_id: str, nodes: int | list[int]) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss over every node (`nodes`: their number, or their --node-ranks in the
    order they trained); a step done twice counts with its last value."""
    return {(r["rank"], r["step"]): r["loss"] for node in (range(nodes) if isinstance(nodes, int) else nodes)
            for r in records(_run_dir(tmp_path, run_id, node), "step") if "loss" in r}


def _pid(run_dir, rank: int) -> int:
    return [r["pid"] for r in records(run_dir, "ready") if r["rank"] == rank][0]


def _spare(supervisor_pid: int) -> int:
    """A spare node's warm worker (spawned: a spare node keeps no spare source)."""
    for p in psutil.Process(supervisor_pid).children():
        try:
            if p.environ().get("GPUHERD_SPARE") == "1":
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError("no warm spare found")


@pytest.mark.parametrize("nnodes", [2, 3])
def test_a_rank_lost_on_node_1_is_replaced_by_its_spare_while_every_other_node_keeps_its_processes(
        tmp_path, tmp_path_factory, python_env, nnodes):
    expected = _shared_uninterrupted(tmp_path_factory, python_env, nnodes)

    kill_at = random.randint(3, STEPS - 10)  # steps left for the kill to land before the end
    procs = _start(tmp_path, python_env, "live", nnodes, "--max-restarts", "1")
    dirs = [_run_dir(tmp_path, "live", node) for node in range(nnodes)]
    try:
        assert wait_for(lambda: any(r["step"] >= kill_at for r in records(dirs[1], "step")), timeout=240,
                        interval=0.02)
        pids = {node: _pid(dirs[node], node) for node in range(nnodes)}  # one rank per node: rank = node
        spare = next_spare(procs[1].pid).pid  # node 1's pool: a fork of its spare source
        psutil.Process(pids[1]).send_signal(signal.SIGKILL)
    finally:
        outputs = [finish(p, timeout=300) for p in procs]
    for node, (code, _out, err) in enumerate(outputs):
        assert code == 0, f"node {node}, rank 1 killed at step {kill_at}: {err[-3000:]}"

    for node in range(nnodes):
        summary = orjson.loads((dirs[node] / "summary.json").read_bytes())
        assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, f"node {node}"  # nobody restarted
        (rec,) = summary["recoveries"]  # every node records the job's recovery, numbered alike
        assert rec["outcome"] == "recovered" and rec["number"] == 1 and rec["node"] == 1 and rec["rank"] == 1
        assert rec["lost_pid"] == pids[1] and rec["replaced_by_pid"] == spare
        assert rec["steps_redone"] <= 1 and rec["checkpoint_reads"] == 0
        kept = [] if node == 1 else [{"rank": node, "pid": pids[node]}]  # one rank per node: rank = node
        assert rec["survivors"] == kept
        assert {w["rank"]: w["pid"] for w in summary["workers"]} == {node: spare if node == 1 else pids[node]}
    assert "live recovery 1: node 1's rank 1" in outputs[0][2]
    got = _losses(tmp_path, "live", nnodes)
    assert {key: expected[key] for key in got} == got  # bit for bit
    assert {key for key in expected if key not in got} <= {(1, rec["resumed_step"] - 1)}


def test_a_node_that_dies_whole_is_replaced_by_a_spare_node_while_the_other_nodes_keep_their_processes(
        tmp_path, tmp_path_factory, python_env):
    nnodes = 3
    expected = _shared_uninterrupted(tmp_path_factory, python_env, nnodes)

    kill_at = random.randint(3, STEPS - 12)  # steps left for the spare node's workers to start before the end
    procs = _start(tmp_path, python_env, "spare", nnodes, "--max-restarts", "1", spare_nodes=1)
    dirs = [_run_dir(tmp_path, "spare", node) for node in range(nnodes + 1)]
    try:
        assert wait_for(lambda: any(r["step"] >= kill_at for r in records(dirs[2], "step")), timeout=240,
                        interval=0.02)
        pids = {node: _pid(dirs[node], node) for node in range(nnodes)}  # one rank per node: rank = node
        warm = _spare(procs[3].pid)  # the spare node's warm worker, standing by
        tree = [procs[2].pid, *(p.pid for p in psutil.Process(procs[2].pid).children(recursive=True))]
        for pid in tree:  # the machine gone: its supervisor, node agent, orphan guard, workers and spares at once
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).send_signal(signal.SIGKILL)
    finally:
        outputs = [finish(p, timeout=300) for p in procs]
    for node in (0, 1, 3):
        code, _out, err = outputs[node]
        assert code == 0, f"node {node}, node 2 killed at step {kill_at}: {err[-3000:]}"

    for node in (0, 1, 3):
        summary = orjson.loads((dirs[node] / "summary.json").read_bytes())
        assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, f"node {node}"  # nobody restarted
        (rec,) = summary["recoveries"]  # every node records the job's recovery
        assert rec["outcome"] == "recovered" and rec["action"] == "spare-node", f"node {node}: {rec}"
        assert rec["node"] == 2 and rec["rank"] == 2 and rec["spare_node"] == 3
        assert rec["checkpoint_reads"] == 0
        if node != 3:  # a survivor: its rank kept its process
            assert rec["survivors"] == [{"rank": node, "pid": pids[node]}] and rec["steps_redone"] <= 1
            assert {w["rank"]: w["pid"] for w in summary["workers"]} == {node: pids[node]}
        else:  # the spare node's warm worker trained node 2's rank from the rebuilt group on
            assert {w["rank"]: w["pid"] for w in summary["workers"]} == {2: warm} == {2: rec["replaced_by_pid"]}
    assert "live recovery 1: node 2 died whole -> spare node 3 took its ranks" in outputs[0][2]  # the job's summary
    got = _losses(tmp_path, "spare", [0, 1, 2, 3])  # node 2's steps before its death, then the spare node's
    assert {key: expected[key] for key in got} == got  # bit for bit
    assert all((rank, STEPS - 1) in got for rank in range(nnodes))  # the job trained to its end
