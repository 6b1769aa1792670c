"""A dataset cache truncated under a live run: the worker reading it dies of SIGBUS (its
memory map now reaches past the file's end). The run names the cache as the root cause and
exits 3 (a data error), instead of a bare "killed by SIGBUS"."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson

from tests.e2e.helpers import records
from tests.supervisor.helpers import finish, wait_for


def test_a_cache_truncated_under_a_live_run_is_named_and_exits_3(tmp_path, python_env):
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--nproc", "1", "--run-id", "cut"]
    for item in ("system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32",
                 "model.n_layers=1", "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16",
                 "training.batch_size=2", "training.max_steps=100000", "training.warmup_steps=5",
                 "training.log_every=1", "training.eval_every=0", "training.save_every=0", "training.num_workers=0"):
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=python_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    run_dir = tmp_path / "logs" / "cut"
    try:
        assert wait_for(lambda: any(r["step"] >= 3 for r in records(run_dir, "step")), timeout=120)
        (tokens,) = (tmp_path / "cache" / "datasets").glob("*/tokens.bin")
        os.truncate(tokens, 4096)  # another process cuts the file the worker has mapped
    finally:
        code, _out, err = finish(proc, timeout=120)
    assert code == 3, err[-3000:]
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    message = summary["root_cause"]["message"]
    assert f"dataset cache {tokens.parent}" in message and "killed by SIGBUS" in message, message
