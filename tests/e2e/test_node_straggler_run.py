"""A whole node slower than the others, named through the whole product: two supervisors on
localhost run one job (`--nnodes 2`, one CPU rank each, the built-in trainer); node 1's rank is
slowed to a quarter of its speed from outside (bench/slow_rank.py). Node 1's own supervisor has
no rank to compare it with, so only the nodes' paces can tell: node 0 names node 1 (console,
metrics.jsonl, summary.json), once, after the slowdown, never itself. (No node named on noise:
tests/supervisor/test_node_stragglers.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import orjson
import pytest

from bench.launchers import tree_pids
from bench.slow_rank import SlowDown
from tests.e2e.helpers import records, running
from tests.e2e.test_live_recovery_run import TINY
from tests.supervisor.helpers import finish, wait_for
from tests.worker.helpers import free_port

STEPS = 100000  # stopped with Ctrl-C once named


def _start(tmp_path, python_env) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--run-id", "ns", "--spares", "0"]
        for item in [*TINY, f"training.max_steps={STEPS}"]:  # a later --set wins
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _node_stragglers(run_dir) -> list[dict]:
    return [r for r in records(run_dir, "straggler") if r.get("node") is not None]


@pytest.mark.slow  # two nodes, ~30 s of training
def test_a_node_slowed_whole_is_named_on_node_0_and_no_node_before_it(tmp_path, python_env):
    procs = _start(tmp_path, python_env)
    dirs = [tmp_path / "logs" / f"ns-node{node}" for node in range(2)]
    slow = None
    named = False
    try:
        assert wait_for(lambda: any(r["step"] >= 20 for r in records(dirs[0], "step") if "step" in r),
                        timeout=240, interval=0.05)
        pid = next(r["pid"] for r in records(dirs[1], "ready"))
        slowed_at, slowed_wall = time.monotonic(), time.time()
        slow = SlowDown(pid, 4.0, measure=3.0).start()
        named = wait_for(lambda: _node_stragglers(dirs[0]), timeout=90, interval=0.2)
        named_after = time.monotonic() - slowed_at
    finally:
        if slow is not None:
            slow.stop()
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        outputs = [finish(p, timeout=120) for p in procs]
    tails = "\n".join(f"--- node {n} (exit {code}):\n{err[-3000:]}" for n, (code, _o, err) in enumerate(outputs))
    assert named, f"node 1 not named within 90 s of its slowdown:\n{tails}"
    assert [code for code, _o, _e in outputs] == [130, 130], tails

    (found,) = _node_stragglers(dirs[0])  # named once, and it is node 1, after its slowdown
    assert found["time"] > slowed_wall
    assert found["node"] == 1 and found["rank"] is None and found["slowdown"] > 1.3 and found["windows"] == 3
    err0 = outputs[0][2]
    assert "straggler: node 1 computes" in err0 and "slower than the median of the other nodes" in err0
    assert "straggler: node 0" not in err0 and _node_stragglers(dirs[1]) == []  # only node 0 judges
    summary = orjson.loads((dirs[0] / "summary.json").read_bytes())
    assert [(s["node"], s["attempt"]) for s in summary["stragglers"]] == [(1, 0)]
    assert "straggler: node 1 computed" in err0  # the summary's own line
    assert not [r for r in records(dirs[0], "straggler") if r.get("rank") is not None]  # no rank named
    print(next(line for line in err0.splitlines() if "straggler: node 1 computes" in line), f"({named_after:.1f} s)")


def _moved_out(run_dir) -> list[dict]:
    return [r for r in _node_stragglers(run_dir) if r.get("moved_out")]


@pytest.mark.slow  # three nodes (one a spare node), ~30 s of training
def test_a_node_slowed_whole_is_moved_out_to_the_spare_node_and_the_job_goes_on_at_its_pace(tmp_path, python_env):
    port = free_port()
    procs = []
    for node in range(3):  # nodes 0 and 1 train, node 2 stands by (--spare-nodes 1)
        cmd = [sys.executable, "-m", "supervisor", "--set", "system.device=cpu", "--no-report", "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--run-id", "nm", "--max-restarts", "1", "--spare-nodes", "1"]
        for item in [*TINY, f"training.max_steps={STEPS}", "system.straggler_move_after_s=10"]:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    dirs = [tmp_path / "logs" / f"nm-node{node}" for node in range(3)]
    slow = None
    moved_out = None
    try:
        assert wait_for(lambda: any(r["step"] >= 10 for r in records(dirs[0], "step") if "step" in r)
                        or any(p.poll() is not None for p in procs), timeout=240, interval=0.05)
        assert all(p.poll() is None for p in procs)
        pid = next(r["pid"] for r in records(dirs[1], "ready"))
        node1 = tree_pids(procs[1].pid)  # its supervisor, agent, orphan guard, rank and warm spare
        slowed_at = time.monotonic()
        slow = SlowDown(pid, 4.0, measure=3.0).start()
        moved_out = finish(procs[1], timeout=120)  # node 1 leaves on its own once moved out
        moved_after = time.monotonic() - slowed_at
        at = max(r["step"] for r in records(dirs[0], "step") if "step" in r)
        # the spare node, now node 1, trains on with node 0: more steps at full pace
        went_on = wait_for(lambda: any(r["step"] >= at + 5 for r in records(dirs[2], "step") if "step" in r),
                           timeout=120, interval=0.1)
        left = wait_for(lambda: not running(node1), timeout=30)
    finally:
        if slow is not None:
            slow.stop()
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        outputs = [finish(p, timeout=120) if p is not procs[1] or moved_out is None else moved_out for p in procs]
    tails = "\n".join(f"--- node {n} (exit {code}):\n{err[-3000:]}" for n, (code, _o, err) in enumerate(outputs))
    assert went_on, tails
    assert left, f"node 1's processes outlived it: {node1}"
    assert [code for code, _o, _e in outputs] == [130, 0, 130], tails  # node 1 left as told; the job went on

    (move,) = _moved_out(dirs[0])
    assert move["node"] == 1 and move["slowdown"] > 2.0 and move["held_s"] >= 10
    err0, err1 = outputs[0][2], outputs[1][2]
    assert "straggler: node 1 moved out: told to leave, a spare node takes its place" in err0, tails
    assert "this node was moved out of the job by node 0, a spare node taking its place: node 1 computed" in err1
    assert "Traceback" not in err1 and "lost the job store" not in err1
    summary = orjson.loads((dirs[0] / "summary.json").read_bytes())
    assert summary["restarts"] == 0 and len(summary["attempts"]) == 1  # a live recovery, no restart
    (rec,) = summary["recoveries"]
    assert rec["action"] == "spare-node" and rec["node"] == 1 and rec["spare_node"] == 2, rec
    assert "was moved out as a straggler" in rec["failed"] and rec["outcome"] == "recovered"
    assert [s["node"] for s in summary["stragglers"] if s.get("moved_out")] == [1]
    assert "straggler: node 1 computed" in err0 and "moved out, a spare node took its place" in err0  # the summary
    assert summary["goodput"]["badput_s"]["straggler"] > 0  # node 0's ranks waited at its pace until the move
    ended = orjson.loads((dirs[1] / "summary.json").read_bytes())
    assert ended["root_cause"] is None and any("moved out of the job by node 0" in n for n in ended["notes"])
    print(f"node 1 moved out {moved_after:.1f} s after its slowdown")
