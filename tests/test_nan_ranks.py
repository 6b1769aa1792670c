"""Two real gloo ranks under DDP: a poisoned batch on rank 1 only.

Both ranks must skip and stop together (nobody hangs), the report must name
rank 1 as the origin, only rank 1 writes rank-suffixed dumps, and the
checkpoint callback runs on both ranks with the same path.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
from nan_helpers import POISON, TinyLM

REPO = Path(__file__).resolve().parents[1]
HELPER = Path(__file__).with_name("nan_helpers.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nanranks")
    out, ckpt = tmp / "out", tmp / "ckpt"
    out.mkdir()
    store = f"file://{tmp / 'store'}"
    procs = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "GPUHERD_DEVICE_KIND": "cpu", "GPUHERD_DEVICE_ID": str(rank),
                   "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen(
                [sys.executable, str(HELPER), store, str(out), str(ckpt)], env=env, cwd=tmp,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:  # never leave a rank behind, even on a timeout
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {"out": out, "ckpt": ckpt, "codes": [p.returncode for p in procs],
            "stderr": [err for _, err in results]}


def _lines(stderr: str) -> list[str]:
    return [line.removeprefix("ERROR | ") for line in stderr.splitlines() if line.startswith("ERROR | ")]


def test_both_ranks_skip_then_stop_together_with_exit_code_6(run):
    assert run["codes"] == [6, 6], run["stderr"]
    for rank in range(2):
        got = json.loads((run["out"] / f"rank{rank}.json").read_text())
        assert got["applied"] == [False, True, False]  # step 3 raised instead of returning
        sums = got["checksums"]
        assert sums[1] != sums[0] and sums[2] == sums[1]  # applied, then skipped: unchanged
        assert got["stop_ranks"] == [1]
        assert got["saved"] == [str(run["ckpt"] / "nan_grad_step_3.pt")]


def test_checkpoint_written_through_the_callback_loads(run):
    state = torch.load(run["ckpt"] / "nan_grad_step_3.pt", weights_only=True)
    TinyLM().load_state_dict(state)  # strict: every name matches the clean model


def test_only_the_poisoned_rank_dumps_and_the_dump_names_it(run):
    debug = run["ckpt"] / "debug"
    assert sorted(p.name for p in debug.iterdir()) == [
        f"nan_debug_step_{s}_rank1.pkl" for s in (0, 2, 3)]
    data = pickle.loads((debug / "nan_debug_step_3_rank1.pkl").read_bytes())
    assert data["rank"] == 1 and data["world_size"] == 2 and data["tag"] == "CPU1"
    assert np.any(data["batch_token_ids"][0] == POISON)
    assert data["first_bad_module"]["module"] == "magnitude"
    ranks = {r["rank"]: r for r in data["ranks"]}
    assert ranks[1]["loss_bad"] and ranks[1]["first_bad_module"] == "magnitude"
    assert not ranks[0]["loss_bad"] and ranks[0]["grad_norm_bad"]  # received through the all-reduce
    assert ranks[0]["first_bad_gradient"] is None and ranks[0]["first_bad_module"] is None
    assert ranks[0]["host"] == ranks[1]["host"] == socket.gethostname()
    assert data["action"] == "stop"
    assert pickle.loads((debug / "nan_debug_step_0_rank1.pkl").read_bytes())["action"] == "skip"


def test_banner_on_the_bad_rank_and_a_pointer_on_the_other(run):
    bad, good = _lines(run["stderr"][1]), _lines(run["stderr"][0])
    assert bad.count("NaN LOSS DETECTED [CPU 1]") == 3
    assert "Ranks that produced the non-finite values: [1] of 2" in bad
    host = socket.gethostname()
    assert any(line.startswith(f"  rank 1 [CPU 1] cpu on {host}: loss nan, first bad module magnitude")
               for line in bad)
    assert "  ranks [0]: non-finite gradients received through the all-reduce" in bad
    # relative to the working directory, as the seed prints `.checkpoints/...`
    assert "Checkpoint saved: ckpt/nan_grad_step_3.pt" in bad
    assert "Debug tensors saved: ckpt/debug/nan_debug_step_3_rank1.pkl" in bad
    assert not any("DETECTED" in line for line in good)
    assert "[CPU 0] Non-finite loss/gradients at step 3 produced on rank(s) [1]; full report from rank(s) [1]" in good
    assert "[CPU 0] Stopping at step 3 (2 non-finite steps in a row > debug.max_nan_skips=1); exit code 6" in good


def test_status_records_from_both_ranks(run):
    for rank in range(2):
        records = [orjson.loads(line) for line in (run["out"] / f"status{rank}.jsonl").read_bytes().splitlines()]
        assert [(r["type"], r["step"], r["action"], r["ranks"]) for r in records] == [
            ("nan", 0, "skip", [1]), ("nan", 2, "skip", [1]), ("nan", 3, "stop", [1])]
        assert all(r["rank"] == rank for r in records)
        assert (records[-1]["report"] is not None) == (rank == 1)
