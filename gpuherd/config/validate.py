"""Validating a whole config: every field against the limits declared on it, then the
rules that relate fields to each other or to files on disk."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpuherd.config.data_sources import validate_data_sources
from gpuherd.config.limits import field_limits
from gpuherd.config.schema import BUILTIN_TOKENIZERS, SECTIONS, Config
from gpuherd.errors import ConfigError
from gpuherd.text import has_undecodable, printable

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def validate(cfg: Config, files: bool = True) -> None:
    """Raise ConfigError (one line, naming the field) for the first problem found. `files`: the
    files it names (data, tokenizer, checkpoint) are checked too; False where the config is
    checked for other machines, whose files may differ (`gpuherd sbatch`: the job's nodes)."""
    for section_name in SECTIONS:
        section = getattr(cfg, section_name)
        for f in dataclasses.fields(section):
            dotted, value = f"{section_name}.{f.name}", getattr(section, f.name)
            _check_int64(dotted, value)
            _check_text(dotted, value)
            limits = field_limits(f)
            if limits is not None:
                limits.check(dotted, value)
    _check_model_shape(cfg)
    _check_relations(cfg)
    if files:
        _check_files(cfg)


def _check_int64(dotted: str, value: object) -> None:
    """Every integer is a signed 64-bit number: torch, numpy, JSON writers and the
    status channel all stop there, and nothing a run counts gets near it."""
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, int) and not isinstance(item, bool) and not INT64_MIN <= item <= INT64_MAX:
            shown = str(item) if item.bit_length() <= 256 else f"a {item.bit_length()}-bit number"
            raise ConfigError(f"{dotted} must fit in a signed 64-bit integer (at most {INT64_MAX}), got {shown}")


def _check_text(dotted: str, value: object) -> None:
    """Every string is UTF-8 without NUL bytes: config.json, the cache's metadata and summary.json are JSON, which
    holds no undecodable bytes (a path in another encoding, or typed under a non-UTF-8 locale)."""
    if isinstance(value, dict):
        for item in value.values():
            _check_text(dotted, item)
    elif isinstance(value, list):
        for item in value:
            _check_text(dotted, item)
    elif isinstance(value, str) and "\x00" in value:
        # no file name, environment variable or argument can carry one: the OS cuts or refuses it
        shown = printable(value).replace("\x00", "\\x00")
        raise ConfigError(f"{dotted} '{shown}' holds a NUL byte (\\x00), which no path, name or value can contain")
    elif isinstance(value, str) and has_undecodable(value):
        raise ConfigError(f"{dotted} '{printable(value)}' holds bytes that are not UTF-8 (a name in another "
                          "encoding, or typed under a non-UTF-8 locale such as LC_ALL=C with PYTHONUTF8=0): "
                          "rename it, or run under a UTF-8 locale (LC_ALL=C.UTF-8)")


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
    if cfg.system.device == "cpu" and (cfg.system.gpus is not None or cfg.system.device_id is not None):
        named = (f"system.gpus {','.join(map(str, cfg.system.gpus))} (--gpus)" if cfg.system.gpus is not None
                 else f"system.device_id {cfg.system.device_id}")
        raise ConfigError(f"{named} names GPUs, but system.device=cpu runs CPU workers: drop one of the two")
    if cfg.system.spares > 0 and cfg.system.max_restarts == 0:
        raise ConfigError(f"system.spares={cfg.system.spares} needs system.max_restarts > 0 (--max-restarts N): each "
                          "live recovery uses one restart")
    if cfg.system.spare_nodes > 0 and (cfg.system.max_restarts == 0 or cfg.system.spares == 0):
        raise ConfigError(f"system.spare_nodes={cfg.system.spare_nodes} needs system.max_restarts > 0 (--max-restarts "
                          "N) and live recovery on (system.spares != 0): a spare node's promotion is a live "
                          "recovery and uses one restart")
    if cfg.system.min_replicas > 0 and cfg.system.max_restarts == 0:
        raise ConfigError(f"system.min_replicas={cfg.system.min_replicas} needs system.max_restarts > 0 (--max-restarts "
                          "N): each shrink uses one restart")
    if 0 < cfg.system.straggler_factor <= 1:
        raise ConfigError(f"system.straggler_factor must be 0 (off) or > 1, got {cfg.system.straggler_factor}")
    d = cfg.debug
    if d.spike_policy != "off" and not d.nan_detection:
        raise ConfigError(f"debug.spike_policy={d.spike_policy} needs debug.nan_detection=true "
                          "(one per-step check judges both)")


def _check_files(cfg: Config) -> None:
    t, d = cfg.training, cfg.data
    if t.deepspeed_config and not Path(t.deepspeed_config).is_file():
        raise ConfigError(f"training.deepspeed_config file not found: {t.deepspeed_config}")
    validate_data_sources(d)
    if d.tokenizer not in BUILTIN_TOKENIZERS and not Path(d.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer '{d.tokenizer}' is neither a built-in ({', '.join(BUILTIN_TOKENIZERS)}) nor an existing tokenizer.json"
        )
    if t.resume not in (None, "auto") and not Path(t.resume).exists():
        raise ConfigError(f"training.resume checkpoint not found: {t.resume}")
