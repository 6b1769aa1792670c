"""Building a config: preset -> `--config FILE.json` (partial, nested) -> `--max-steps`
-> `--set section.key=value`, paths made absolute, then validated as a whole, then the
defaults that depend on other settings settled (`--spares -1`), so every reader of the config
(the supervisor, config.json, the workers) sees the one value the run uses."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from gpuherd.bounded_read import NotAFile, TooLarge, read_bounded
from gpuherd.config.data_sources import absolutize_data_sources
from gpuherd.config.jsonc import strip_json_comments
from gpuherd.config.merge import merge, set_dotted
from gpuherd.config.paths import absolute
from gpuherd.config.presets import DEFAULT_PRESET, preset
from gpuherd.config.schema import BUILTIN_TOKENIZERS, Config
from gpuherd.config.validate import validate
from gpuherd.errors import ConfigError

JSON_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
MAX_CONFIG_BYTES = 16 << 20  # far above any config written by hand or by a tool; a stray device fills it fast


def resolve(
    preset_name: str | None = None,
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    max_steps: int | None = None,
    cwd: Path | None = None,
    files: bool = True,
) -> Config:
    """Build, merge and validate a config; raises ConfigError with one line. `files`: validate()'s."""
    cwd = Path.cwd() if cwd is None else cwd
    cfg = preset(preset_name or DEFAULT_PRESET)
    if config_file is not None:
        merge(cfg, read_json_file(absolute(config_file, cwd)), source=str(config_file))
    if max_steps is not None:
        set_dotted(cfg, "training.max_steps", max_steps, source="--max-steps")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects section.key=value, got '{item}'")
        set_dotted(cfg, key.strip(), parse_value(text.strip()), source="--set")
    _absolutize_paths(cfg, cwd)
    validate(cfg, files)
    settle_defaults(cfg)
    return cfg


def settle_defaults(cfg: Config) -> None:
    """The defaults whose value depends on another setting, decided once: system.spares -1 (the
    default) is one warm spare per node whenever restarts are allowed, else none. Validated
    first, so a limit names what was typed; what is settled passes validation by construction."""
    if cfg.system.spares == -1:
        cfg.system.spares = 1 if cfg.system.max_restarts > 0 else 0


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON config file; `//` and `/* */` comments are allowed (hand-written example
    configs carry them), trailing text is not."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:  # a pipe (`--config <(...)`, /dev/stdin) is read like a file; a device is refused (/dev/zero never ends)
        text = read_bounded(path, MAX_CONFIG_BYTES, pipes=True).decode("utf-8")
    except NotAFile as exc:
        raise ConfigError(f"config file {path} is {exc}; --config takes a JSON file (or a pipe: <(...))") from None
    except TooLarge:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB, the limit for a config "
                          "file; --config takes a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        raw = orjson.loads(strip_json_comments(text))
    except orjson.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: top level must be an object of sections")
    return raw


def parse_value(text: str) -> Any:
    """`--set` values: JSON when it parses (1e-4, true, null, [0,1]), else a string. A JSON
    integer is taken exactly: orjson reads one past 64 bits as a float, and the 64-bit check
    then named 99999999999999991611392 for the 99999999999999999999999 typed."""
    if JSON_INTEGER.fullmatch(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            return text
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _absolutize_paths(cfg: Config, cwd: Path) -> None:
    """Paths a user typed are relative to where they ran the command; store them
    absolute so workers (and later resumes) read the same files."""
    cfg.system.run_root = str(absolute(cfg.system.run_root, cwd))
    cfg.system.checkpoint_dir = str(absolute(cfg.system.checkpoint_dir, cwd))
    cfg.data.cache_dir = str(absolute(cfg.data.cache_dir, cwd))
    absolutize_data_sources(cfg.data, cwd)
    if cfg.data.tokenizer not in BUILTIN_TOKENIZERS:
        cfg.data.tokenizer = str(absolute(cfg.data.tokenizer, cwd))
    if cfg.training.deepspeed_config:
        cfg.training.deepspeed_config = str(absolute(cfg.training.deepspeed_config, cwd))
    if cfg.training.resume not in (None, "auto"):
        cfg.training.resume = str(absolute(cfg.training.resume, cwd))
