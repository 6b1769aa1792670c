"""Two supervisors on localhost train one model with the built-in trainer (`--nnodes 2`,
one CPU worker each): one gloo process group across the "nodes", DDP keeps them in step, and
their output reads as one job's (issue 23: under SLURM every node's output lands in one file)."""

from __future__ import annotations

import socket
import subprocess
import sys

import orjson

from tests.supervisor.helpers import finish

TINY = ["data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=2", "model.dim=32",
        "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
        "training.grad_accum_nums=1", "training.max_steps=6", "training.warmup_steps=1", "training.log_every=1",
        "training.eval_every=0", "training.save_every=0"]


def test_two_nodes_train_one_model(tmp_path, python_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "supervisor", "--debug", "--set", "system.device=cpu", "--no-report", "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "--run-id", "job"]
        for item in TINY:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [finish(p, timeout=300) for p in procs]
    for code, _out, err in outputs:
        assert code == 0, err[-3000:]
    assert "strategy ddp x2" in outputs[0][2]  # rank 0 (node 0) reports the whole group
    losses = {}
    for node in (0, 1):
        for line in (tmp_path / "logs" / f"job-node{node}" / "metrics.jsonl").read_bytes().splitlines():
            r = orjson.loads(line)
            if r.get("type") == "step" and r.get("step") == 5 and "loss" in r:
                losses[r["rank"]] = r["loss"]
    assert set(losses) == {0, 1}
    _one_readable_stream(tmp_path, outputs[0][2], outputs[1][2])


def _one_readable_stream(tmp_path, err0: str, err1: str) -> None:
    """Lines name the node (every node's first worker is CPU0), the console carries rank 0's
    training lines only (rank 1's stay in its log file), and node 0 prints the job's one summary
    with every node's outcome while node 1 points to it."""
    assert "n0/CPU0:INFO | [CPU 0] Step [5/6]" in err0 and "n0/supervisor:INFO | " in err0
    assert "n1/supervisor:INFO | " in err1
    for err in (err0, err1):
        assert not [line for line in err.splitlines() if line.startswith(("CPU", "supervisor:"))], err[-3000:]
    assert "Step [" not in err1
    assert "Step [5/6]" in (tmp_path / "logs" / "job-node1" / "worker-rank1-CPU0.log").read_text()
    assert err0.count("gpuherd: run job finished") == 1 and "gpuherd: run job" not in err1
    nodes = [line for line in err0.splitlines() if line.startswith("node ")]
    assert [line.split(" (")[0] for line in nodes] == ["node 0", "node 1"], err0[-3000:]
    assert all("exit 0 (success)" in line for line in nodes) and "logs/job-node1" in nodes[1]
    assert (f"gpuherd: node 1 ended with exit 0; the job's summary is printed by node 0; this node's: "
            f"{tmp_path / 'logs' / 'job-node1' / 'summary.json'}") in err1
    outcomes = orjson.loads((tmp_path / "logs" / "job-node0" / "summary.json").read_bytes())["node_outcomes"]
    assert [(o["node"], o["exit_code"]) for o in outcomes] == [(0, 0), (1, 0)]
