"""Named starting points for a config: `debug`, `production` (the default) and `gpt2-small`."""

from __future__ import annotations

from collections.abc import Callable

from gpuherd.config.schema import Config, DataConfig, DebugConfig, ModelConfig, SystemConfig, TrainingConfig
from gpuherd.errors import ConfigError
from gpuherd.text import did_you_mean


def _debug() -> Config:
    """2 layers, 10 steps, debug logging, NaN hooks, conservative numerics, no compile wait."""
    cfg = Config(preset="debug")
    cfg.model = ModelConfig(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, multiple_of=32)
    cfg.training = TrainingConfig(
        batch_size=4, grad_accum_nums=2, learning_rate=3e-4, max_steps=10, warmup_steps=2,
        use_amp=False, log_every=1, eval_every=5, eval_steps=2, save_every=0, keep_last=2, compile=False,
    )
    cfg.data = DataConfig(context_length=128)
    cfg.debug = DebugConfig(enabled=True, log_level="DEBUG", nan_hooks=True)
    cfg.system = SystemConfig(grace_period=3.0, rendezvous_timeout=60.0)
    return cfg


def _production() -> Config:
    """32 layers, 10000 steps: a Llama-3-8B-shaped model (GQA 32/8, dim 4096)."""
    return Config(preset="production")


def _gpt2_small() -> Config:
    """~124M parameters, GPT-2-small shaped: fits and trains fast on one GPU."""
    cfg = Config(preset="gpt2-small")
    cfg.model = ModelConfig(n_layers=12, dim=768, n_heads=12, n_kv_heads=None, tie_embeddings=True)
    cfg.training = TrainingConfig(
        batch_size=16, grad_accum_nums=4, learning_rate=6e-4, max_steps=5000, warmup_steps=200,
        log_every=10, eval_every=250, save_every=1000,
    )
    cfg.data = DataConfig(context_length=1024)
    return cfg


PRESETS: dict[str, Callable[[], Config]] = {
    "debug": _debug,
    "production": _production,
    "gpt2-small": _gpt2_small,
}
DEFAULT_PRESET = "production"  # `pretrain_main.py` with no options trains the full-size model


def preset(name: str) -> Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown preset '{name}'{did_you_mean(name, PRESETS)}; presets: {', '.join(PRESETS)}"
        ) from None
