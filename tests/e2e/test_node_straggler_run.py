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

from bench.slow_rank import SlowDown
from tests.e2e.helpers import records
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
