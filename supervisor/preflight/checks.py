"""Every check before a run writes or spawns anything, in one call (`preflight`)."""

from __future__ import annotations

from pathlib import Path

from gpuherd.config import Config
from gpuherd.model_size import ModelSize
from supervisor.gpus import DevicePlan
from supervisor.preflight.limits import check_backend, check_worker_count, ensure_open_files
from supervisor.preflight.paths import check_directory, check_room, probe_writable


def preflight(cfg: Config, plan: DevicePlan, train: bool) -> None:
    """Raises PreflightError (exit 2) for the first problem; `train`: the built-in trainer
    (a --script keeps its own checkpoints, data and backend)."""
    check_worker_count(plan.world_size)
    ensure_open_files(plan.world_size)
    run_root = Path(cfg.system.run_root)
    probe_writable("system.run_root", run_root, check_directory("system.run_root", run_root))
    if not train:
        return
    check_backend(cfg.system.backend, plan.kind)
    check_directory("data.cache_dir", Path(cfg.data.cache_dir))
    ckpt = Path(cfg.system.checkpoint_dir)
    existing = check_directory("system.checkpoint_dir", ckpt)
    probe_writable("system.checkpoint_dir", ckpt, existing)
    check_room("system.checkpoint_dir", ckpt, existing, ModelSize.of(cfg.model, planned_vocab(cfg)))


def planned_vocab(cfg: Config) -> int:
    """The embedding rows the worker will build: model.vocab_size, or the tokenizer's padded
    (as worker/data.py does). A tokenizer that cannot be read is the dataset step's to
    report (exit 3); the estimate then counts no embedding."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    try:
        from dataset_cache import DatasetError, load_tokenizer, padded_vocab_size
    except ImportError:
        return 0
    try:
        return padded_vocab_size(load_tokenizer(cfg.data.tokenizer).vocab_size)
    except (DatasetError, OSError, ValueError):
        return 0
