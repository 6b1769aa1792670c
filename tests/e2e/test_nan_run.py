"""Issue 7 through the whole product: a real blow-up under `run_training.sh` stops
every rank with exit code 6, the seed's banner, per-rank pickles and a checkpoint."""

from __future__ import annotations

import subprocess

import orjson
import torch

from tests.worker.nan.helpers import SEED_SNIPPET


def test_exploding_run_stops_with_exit_6_and_the_seed_files(repo_root, tmp_path, python_env):
    result = subprocess.run(
        # the byte tokenizer: a 256-token vocabulary, not GPT-2's 50,304 (the blow-up, not the model's
        # size, is the point: GPT-2's embedding and output layers are 97% of the debug model's parameters)
        ["bash", str(repo_root / "run_training.sh"), "--debug", "--set", "data.dataset=dummy",
         "--set", "data.tokenizer=byte", "--set", "training.learning_rate=1e4", "--set", "training.max_grad_norm=0"],
        cwd=tmp_path, env=python_env, capture_output=True, text=True, timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 6, out[-3000:]
    assert "CPU0:ERROR | NaN GRADIENT DETECTED [CPU 0]" in out
    assert "PROBLEMATIC TENSORS:" in out and "NaN count: " in out

    step = int(next(p.stem for p in (tmp_path / ".checkpoints").glob("nan_grad_step_*.pt")).rsplit("_", 1)[1])
    dumps = sorted((tmp_path / ".checkpoints" / "debug").glob(f"nan_debug_step_{step}_rank*.pkl"))
    assert [p.name for p in dumps] == [f"nan_debug_step_{step}_rank0.pkl", f"nan_debug_step_{step}_rank1.pkl"]
    torch.load(tmp_path / ".checkpoints" / f"nan_grad_step_{step}.pt", weights_only=True)

    snippet = subprocess.run([python_env["GPUHERD_PYTHON"], "-c",
                              SEED_SNIPPET.replace("'.checkpoints/debug/nan_debug_step_0.pkl'", repr(str(dumps[0])))],
                             capture_output=True, text=True, timeout=60)
    assert snippet.returncode == 0, snippet.stderr
    assert "% NaN" in snippet.stdout

    summary = orjson.loads(next((tmp_path / "logs").glob("*/summary.json")).read_bytes())
    assert summary["exit_code"] == 6
    assert "non-finite loss or gradient" in summary["root_cause"]["message"]
