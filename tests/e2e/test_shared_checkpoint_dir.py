"""Two runs sharing one `system.checkpoint_dir`: each run's `keep_last` pruning removes
only the checkpoints its own manifest names, never the other run's."""

from __future__ import annotations

import subprocess
import sys

from gpuherd.checkpoint_manifest import read_manifest

TINY = [
    "system.device=cpu", "data.dataset=dummy", "data.tokenizer=byte", "data.context_length=32", "model.n_layers=1",
    "model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.multiple_of=16", "training.batch_size=2",
    "training.eval_every=0", "training.keep_last=2",
]


def _train(cwd, checkpoints, run_id: str, steps: int, save_every: int, env) -> None:
    cmd = [sys.executable, "-m", "supervisor", "--debug", "--no-report", "--nproc", "1", "--run-id", run_id]
    for item in [*TINY, f"system.checkpoint_dir={checkpoints}", f"training.max_steps={steps}",
                 f"training.save_every={save_every}"]:
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def _owners(checkpoints) -> dict[str, str]:
    return {path.name: read_manifest(path).run_id for path in sorted(checkpoints.glob("step_*.pt"))}


def test_a_run_prunes_only_its_own_checkpoints(tmp_path, python_env):
    checkpoints = tmp_path / "shared"
    _train(tmp_path, checkpoints, "b", steps=4, save_every=2, env=python_env)  # b: steps 2 and 4
    _train(tmp_path, checkpoints, "a", steps=9, save_every=3, env=python_env)  # a: steps 3, 6, 9, keeps 2
    assert _owners(checkpoints) == {"step_0000002.pt": "b", "step_0000004.pt": "b",
                                    "step_0000006.pt": "a", "step_0000009.pt": "a"}
