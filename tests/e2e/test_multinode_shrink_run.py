"""Shrinking instead of stopping across nodes: two supervisors on localhost run one job of 4 ranks
(`--nnodes 2 --nproc 2`, CPU workers, gloo, --min-replicas 2). Node 1's standing spare dies, then
one of node 1's ranks is SIGKILLed mid-run: node 1 claims the shrink on the job store, node 0
writes the decision into the workers' store, and the 3 survivors (both of node 0's among them,
their pids kept) train on with the lost rank's data slot carried; node 1's refilled spare, once
warm, grows the job back at a step boundary. Every (step, data slot) is drawn exactly once, in an
undisturbed run's order, and every loss is within float32 rounding of that run's.

A node lost whole with no spare node (3 nodes x 1 rank, no spares): node 0 claims the shrink of
its ranks instead of the restart; the other nodes train to the end with its data slot carried."""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess

import orjson
import psutil
import pytest

from tests.e2e.helpers import cut_short, records
from tests.e2e.test_live_recovery_run import _command, _pid, _reached
from tests.e2e.test_multinode_live_recovery_run import STEPS, _run_dir, _uninterrupted
from tests.e2e.test_multinode_live_recovery_run import _start as _start_nodes
from tests.e2e.test_shrink_run import AFTER_REGROW, LONG, SAMPLES, _close, _draws, _regrown, no_spare_left, \
    _undisturbed_to
from tests.supervisor.helpers import finish, wait_for
from tests.worker.helpers import free_port


def _start(tmp_path, python_env) -> list[subprocess.Popen]:
    port = free_port()
    return [subprocess.Popen(_command("mn", "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                                      "--master-port", str(port), "--max-restarts", "2", "--spares", "1",
                                      "--min-replicas", "2", *SAMPLES, nproc=2, steps=LONG),
                             cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for node in range(2)]


@pytest.mark.slow  # two 4-rank runs, and the spare's warm-up at nice 19 beside 3 busy ranks
def test_a_rank_lost_on_node_1_with_no_spare_shrinks_the_job_and_its_refilled_spare_grows_it_back(
        tmp_path, tmp_path_factory, python_env):
    kill_at, lost = random.randint(3, 12), random.choice([2, 3])
    procs = _start(tmp_path, python_env)
    dirs = [tmp_path / "logs" / f"mn-node{node}" for node in range(2)]
    missed = ""  # what the job did not do in time; either way both nodes are stopped with Ctrl-C
    try:
        assert wait_for(lambda: _reached(dirs[1], kill_at), timeout=240, interval=0.02)
        pids = {rank: _pid(dirs[rank // 2], rank) for rank in range(4)}
        killed = no_spare_left(procs[1].pid)  # no spare left on node 1: its standing ones die first
        psutil.Process(pids[lost]).send_signal(signal.SIGKILL)
        if not wait_for(lambda: all((_regrown(d) or {}).get("outcome") == "recovered" for d in dirs), timeout=400,
                        interval=0.1):
            missed = "no regrow recovered on both nodes in 400 s"
        else:
            back = max(_regrown(d)["resumed_step"] for d in dirs)
            if not wait_for(lambda: all(_reached(d, back + AFTER_REGROW) for d in dirs), timeout=120, interval=0.02):
                missed = f"not every node reached step {back + AFTER_REGROW} in 120 s"
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        outputs = [finish(p, timeout=300) for p in procs]
    tails = "\n".join(f"--- node {node} (exit {code}):\n{err[-3000:]}" for node, (code, _o, err) in enumerate(outputs))
    assert not missed, f"{missed}; rank {lost} killed at step {kill_at}:\n{tails}"
    for node, (code, _out, _err) in enumerate(outputs):
        assert code == 130, f"node {node}, rank {lost} killed at step {kill_at}:\n{tails}"

    survivors = {rank: pid for rank, pid in pids.items() if rank != lost}
    for node in range(2):
        summary = orjson.loads((dirs[node] / "summary.json").read_bytes())
        assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, f"node {node}"  # nobody restarted
        shrink, regrow = summary["recoveries"]  # every node records both, numbered alike
        assert [(r["number"], r["action"], r["outcome"], r["node"], r["rank"]) for r in (shrink, regrow)] == [
            (1, "shrink", "recovered", 1, lost), (2, "regrow", "recovered", 1, lost)], f"node {node}"
        assert shrink["replicas"] == 3 and shrink["lost_pid"] == pids[lost] and shrink["checkpoint_reads"] == 0
        assert regrow["replicas"] == 4 and regrow["replaced_by_pid"] not in {0, *killed}
        assert regrow["steps_redone"] == 0 and 0 < shrink["shrunk_s"] and 0 < regrow["shrunk_s"]
        mine = {rank: pid for rank, pid in survivors.items() if rank // 2 == node}
        assert shrink["survivors"] == regrow["survivors"] == [{"rank": r, "pid": p} for r, p in mine.items()]
        expected = {**mine, lost: regrow["replaced_by_pid"]} if node == 1 else mine
        assert {w["rank"]: w["pid"] for w in summary["workers"] if w["exit_code"] == 130} == expected
        assert 0 < summary["goodput"]["shrunk_s"] <= summary["goodput"]["wall_s"]
    err0 = outputs[0][2]
    assert f"live recovery 1: node 1's rank {lost} (CPU{lost - 2}, pid {pids[lost]}) lost with no spare left" in err0
    assert f"regrow: node 1's warm spare pid {regrow['replaced_by_pid']} took back rank {lost}" in err0

    # the same samples in the same order as an undisturbed 4-rank run stopped past the same step
    shrunk_at, back = shrink["resumed_step"], regrow["resumed_step"]
    steps = [r for d in dirs for r in records(d, "step") if "loss" in r]
    last = max(r["step"] for r in steps if r["rank"] == 0)
    plain_dir = _undisturbed_to(last, tmp_path_factory.mktemp("plain-mn"), python_env)
    plain = {(r["rank"], r["step"]): r["loss"] for r in records(plain_dir, "step") if "loss" in r}
    expected = {key: got[0][1] for key, got in _draws(plain_dir).items() if key[0] <= last}
    draws = _merge(dirs)
    # the lost rank's last step before the SIGKILL: kept by the survivors, possibly with no record of its own;
    # and a survivor's that was still in that step's all-reduce when the others completed it
    behind = cut_short(dirs, shrunk_at)
    unrecorded = set(expected) - set(draws)
    assert unrecorded <= {(shrunk_at - 1, rank) for rank in {lost, *behind}}, (unrecorded, shrunk_at, behind)
    assert set(draws) == set(expected) - unrecorded
    carrier = sorted(survivors)[lost % 3]
    for (step, slot), got in draws.items():
        assert {draw for _rank, draw in got} == {expected[(step, slot)]}, (step, slot, got)
        if len(got) > 1:  # drawn twice only where the shrunk group trained the lost rank's last step again
            assert sorted(rank for rank, _d in got) == sorted([lost, carrier]) and slot == lost and step < shrunk_at
    carried = {step for (step, slot), got in draws.items() for rank, _d in got if rank == carrier and slot == lost}
    assert carried == set(range(shrunk_at, back))  # carried while shrunk, only then (by a rank of either node)

    for r in steps:
        assert _close(r["loss"], plain[(r["rank"], r["step"])]), r
        if r["step"] < shrunk_at - 1:
            assert r["loss"] == plain[(r["rank"], r["step"])], r  # bit for bit before the loss
    worst = max(abs(r["loss"] - plain[(r["rank"], r["step"])]) / abs(plain[(r["rank"], r["step"])]) for r in steps)
    print(f"rank {lost} lost (carried by rank {carrier}), shrunk at step {shrunk_at}, regrown at step {back} after "
          f"{regrow['shrunk_s']} s; {last + 1} steps; "
          f"worst relative loss difference {worst:.2e}")


def _merge(dirs) -> dict:
    """(step, data slot) -> every (rank, draw) over both nodes' step records."""
    out: dict = {}
    for d in dirs:
        for key, got in _draws(d).items():
            out.setdefault(key, []).extend(got)
    return out


def test_a_node_lost_whole_with_no_spare_node_shrinks_the_job_onto_the_other_nodes(tmp_path, python_env):
    """3 nodes x 1 rank, --min-replicas 2, no spare (none per node, no spare node): node 2's whole
    process tree is SIGKILLed; node 0 claims a shrink of its rank instead of the restart, nodes 0
    and 1 train on with their pids (one of them carrying rank 2's data slot) to the end, exit 0."""
    nnodes, lost = 3, 2
    expected = _uninterrupted(tmp_path, python_env, nnodes, *SAMPLES)
    plain_dir = tmp_path / "logs" / "plain"
    kill_at = random.randint(3, STEPS - 8)  # steps left for the shrunk group before the end
    procs = _start_nodes(tmp_path, python_env, "node", nnodes, "--max-restarts", "1", "--spares", "0",
                         "--min-replicas", "2", *SAMPLES)
    dirs = [_run_dir(tmp_path, "node", node) for node in range(nnodes)]
    try:
        assert wait_for(lambda: _reached(dirs[lost], kill_at), timeout=240, interval=0.02)
        pids = {node: _pid(dirs[node], node) for node in range(nnodes)}  # one rank per node: rank = node
        tree = [procs[lost].pid, *(p.pid for p in psutil.Process(procs[lost].pid).children(recursive=True))]
        for pid in tree:  # the machine gone: its supervisor, node agent, orphan guard and worker at once
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).send_signal(signal.SIGKILL)
    finally:
        outputs = [finish(p, timeout=300) for p in procs]
    for node in (0, 1):
        code, _out, err = outputs[node]
        assert code == 0, f"node {node}, node {lost} killed at step {kill_at}: {err[-3000:]}"

    for node in (0, 1):
        summary = orjson.loads((dirs[node] / "summary.json").read_bytes())
        assert summary["restarts"] == 0 and len(summary["attempts"]) == 1, f"node {node}"  # nobody restarted
        (rec,) = summary["recoveries"]  # every surviving node records the job's shrink, numbered alike
        assert (rec["outcome"], rec["action"], rec["kind"], rec["node"], rec["rank"], rec["replicas"]) == (
            "recovered", "shrink", "node", lost, lost, 2), f"node {node}: {rec}"
        assert rec["survivors"] == [{"rank": node, "pid": pids[node]}] and rec["steps_redone"] <= 1
        assert rec["checkpoint_reads"] == 0 and 0 < rec["shrunk_s"]
        assert 0 < summary["goodput"]["shrunk_s"] <= summary["goodput"]["wall_s"]  # shrunk from the loss to the end
        assert {w["rank"]: w["pid"] for w in summary["workers"]} == {node: pids[node]}  # kept its process
    err0 = outputs[0][2]
    assert f"live recovery 1: node {lost} died whole -> no spare node left: 2 process(es)" in err0  # the summary
    assert f"node {lost}: lost (" in err0  # the job's node outcomes name it

    # every (step, data slot) drawn exactly once, as the undisturbed 3-rank run drew it, to the end
    resumed = rec["resumed_step"]
    draws = _merge(dirs)
    plain_draws = {key: got[0][1] for key, got in _draws(plain_dir).items()}
    unrecorded = set(plain_draws) - set(draws)
    behind = cut_short(dirs, resumed)  # its last step, kept by the survivors, some of them brought forward to it
    assert unrecorded <= {(resumed - 1, rank) for rank in {lost, *behind}}, (unrecorded, resumed, behind)
    carrier = [0, 1][lost % 2]
    for (step, slot), got in draws.items():
        assert {draw for _rank, draw in got} == {plain_draws[(step, slot)]}, (step, slot, got)
        if len(got) > 1:  # drawn twice only where the shrunk group trained the lost rank's last step again
            assert sorted(rank for rank, _d in got) == sorted([lost, carrier]) and step == resumed - 1
    carried = {step for (step, slot), got in draws.items() for rank, _d in got if rank == carrier and slot == lost}
    assert carried == set(range(resumed, STEPS))  # carried from the shrink to the end
    got = {(r["rank"], r["step"]): r["loss"] for d in dirs for r in records(d, "step") if "loss" in r}
    assert all((rank, STEPS - 1) in got for rank in (0, 1))  # the job trained to its end
    for key, loss in got.items():
        assert _close(loss, expected[key]), (key, loss, expected[key])
        if key[1] < resumed - 1:
            assert loss == expected[key], key  # bit for bit before the loss
    worst = max(abs(loss - expected[key]) / abs(expected[key]) for key, loss in got.items())
    print(f"node {lost} lost at step {kill_at}, shrunk at step {resumed}; worst relative loss difference {worst:.2e}")
