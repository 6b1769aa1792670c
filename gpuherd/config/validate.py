"""Validating a whole config: every field against the limits declared on it, then the
rules that relate fields to each other or to files on disk."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpuherd.config.errors import ConfigError
from gpuherd.config.limits import field_limits
from gpuherd.config.schema import BUILTIN_DATASETS, BUILTIN_TOKENIZERS, SECTIONS, Config


def validate(cfg: Config) -> None:
    """Raise ConfigError (one line, naming the field) for the first problem found."""
    for section_name in SECTIONS:
        section = getattr(cfg, section_name)
        for f in dataclasses.fields(section):
            limits = field_limits(f)
            if limits is not None:
                limits.check(f"{section_name}.{f.name}", getattr(section, f.name))
    _check_model_shape(cfg)
    _check_relations(cfg)
    _check_files(cfg)


def _check_model_shape(cfg: Config) -> None:
    m = cfg.model
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads})")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"head dim model.dim/model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")


def _check_relations(cfg: Config) -> None:
    t = cfg.training
    if t.warmup_steps > t.max_steps:
        raise ConfigError(f"training.warmup_steps ({t.warmup_steps}) must not exceed training.max_steps ({t.max_steps})")
    if t.strategy == "deepspeed" and not t.deepspeed_config:
        raise ConfigError("training.strategy=deepspeed needs training.deepspeed_config (a DeepSpeed JSON file)")
    d = cfg.debug
    if d.spike_policy != "off" and not d.nan_detection:
        raise ConfigError(f"debug.spike_policy={d.spike_policy} needs debug.nan_detection=true "
                          "(one per-step check judges both)")


def _check_files(cfg: Config) -> None:
    t, d = cfg.training, cfg.data
    if t.deepspeed_config and not Path(t.deepspeed_config).is_file():
        raise ConfigError(f"training.deepspeed_config file not found: {t.deepspeed_config}")
    if d.dataset not in BUILTIN_DATASETS and not Path(d.dataset).exists():
        raise ConfigError(
            f"data.dataset '{d.dataset}' is neither a built-in ({', '.join(BUILTIN_DATASETS)}) nor an existing path"
        )
    if d.tokenizer not in BUILTIN_TOKENIZERS and not Path(d.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer '{d.tokenizer}' is neither a built-in ({', '.join(BUILTIN_TOKENIZERS)}) nor an existing tokenizer.json"
        )
    if t.resume not in (None, "auto") and not Path(t.resume).exists():
        raise ConfigError(f"training.resume checkpoint not found: {t.resume}")
