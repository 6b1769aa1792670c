"""Two supervisors on localhost train one model with the built-in trainer (`--nnodes 2`,
one CPU worker each): one gloo process group across the "nodes", DDP keeps them in step."""

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
