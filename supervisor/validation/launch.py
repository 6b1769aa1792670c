"""Every check of a launch before the run writes or spawns anything, in one call."""

from __future__ import annotations

from pathlib import Path

from gpuherd.config import Config
from supervisor.gpus import DevicePlan
from supervisor.validation.limits import check_backend, check_worker_count, ensure_open_files
from supervisor.validation.paths import check_directory, probe_writable


def validate_launch(cfg: Config, plan: DevicePlan, train: bool, hosted_nodes: int = 0) -> None:
    """Raises LaunchError (exit 2) for the first problem; `train`: the built-in trainer
    (a --script keeps its own checkpoints, data and backend); `hosted_nodes`: on node 0 of a
    multi-node job, how many nodes (spare nodes included) its stores serve."""
    check_worker_count(plan.world_size)
    ensure_open_files(plan.world_size, hosted_nodes)
    run_root = Path(cfg.system.run_root)
    probe_writable("system.run_root", run_root, check_directory("system.run_root", run_root))
    if not train:
        return
    check_backend(cfg.system.backend, plan.kind)
    check_directory("data.cache_dir", Path(cfg.data.cache_dir))
    ckpt = Path(cfg.system.checkpoint_dir)
    probe_writable("system.checkpoint_dir", ckpt, check_directory("system.checkpoint_dir", ckpt))
