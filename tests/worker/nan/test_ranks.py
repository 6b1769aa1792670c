"""Two real gloo ranks, a bad batch on rank 1 only, under DDP and FSDP2.

Both ranks must skip and stop together (nobody hangs), the report must name
rank 1 as the origin, dumps are rank-suffixed (only rank 1 under DDP, every
rank's own shards under FSDP), and the checkpoint callback runs on both ranks
with the same path.
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
from tests.worker.nan.helpers import POISON, TinyLM

REPO = Path(__file__).resolve().parents[3]
HELPER = Path(__file__).with_name("helpers.py")


def _launch(tmp_path_factory, scenario: str) -> dict:
    tmp = tmp_path_factory.mktemp(f"nan{scenario}")
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
                [sys.executable, str(HELPER), store, str(out), str(ckpt), scenario], env=env, cwd=tmp,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:  # never leave a rank behind, even on a timeout
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {"out": out, "ckpt": ckpt, "codes": [p.returncode for p in procs],
            "stderr": [err for _, err in results]}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _launch(tmp_path_factory, "ddp")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return _launch(tmp_path_factory, "fsdp")


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
    assert "  ranks [0]: non-finite gradients received through the gradient reduction (all-reduce / reduce-scatter)" in bad
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


def test_fsdp2_backward_nan_is_attributed_and_every_rank_dumps_its_shards(fsdp):
    assert fsdp["codes"] == [6, 6], fsdp["stderr"]
    for rank in range(2):
        got = json.loads((fsdp["out"] / f"rank{rank}.json").read_text())
        assert got["applied"] == [True] and got["stop_ranks"] == [1]
        assert got["saved"] == [str(fsdp["ckpt"] / "nan_grad_step_1.pt")]
    TinyLM().load_state_dict(torch.load(fsdp["ckpt"] / "nan_grad_step_1.pt", weights_only=True))

    bad, good = _lines(fsdp["stderr"][1]), _lines(fsdp["stderr"][0])
    assert "NaN GRADIENT DETECTED [CPU 1]" in bad  # the loss stayed finite: sqrt(0) in backward
    assert "(FSDP: this rank's local shards; counts are over the shard, shapes are global)" in bad
    assert "First module whose input gradient goes non-finite (backward, before reduce-scatter):" \
        " magnitude.proj (micro-batch 0)" in bad
    assert "Ranks that produced the non-finite values: [1] of 2" in bad
    assert not any("DETECTED" in line for line in good)
    assert "Debug tensors saved: ckpt/debug/nan_debug_step_1_rank0.pkl" in good  # its own shards

    dumps = {r: pickle.loads((fsdp["ckpt"] / "debug" / f"nan_debug_step_1_rank{r}.pkl").read_bytes())
             for r in range(2)}
    for rank, data in dumps.items():
        assert data["sharded"] and data["rank"] == rank
        assert any(note.startswith(f"FSDP: rank {rank} dumped its local shards") for note in data["notes"])
        assert data["shapes"]["output.weight"] == [32, 16]
        assert data["parameters"]["output.weight"].shape == (16, 16)  # dim-0 shard of 2 ranks
    whole = np.concatenate([dumps[0]["parameters"]["output.weight"], dumps[1]["parameters"]["output.weight"]])
    saved = torch.load(fsdp["ckpt"] / "nan_grad_step_1.pt", weights_only=True)["output.weight"]
    assert np.array_equal(whole, saved.numpy())  # the two shards are the whole, unmodified weight
