"""The one typed configuration shared by supervisor, worker and dataset cache.

Sections `system`, `model`, `training`, `data`, `debug` (schema.py). A config is
built as: preset (presets.py) -> `--config FILE.json` (partial, nested, comments
allowed: jsonc.py) -> `--max-steps` -> `--set section.key=value` (merge.py,
coerce.py), then validated as a whole (validate.py, from the limits declared on
each field: limits.py). Every problem is a `ConfigError` with one line naming
the culprit; callers turn it into exit code 2 before anything is spawned or written.
"""

from gpuherd.config.data_sources import is_glob
from gpuherd.config.presets import DEFAULT_PRESET, PRESETS, preset
from gpuherd.config.resolve import parse_value, read_json_file, resolve
from gpuherd.config.schema import (
    BUILTIN_DATASETS,
    BUILTIN_TOKENIZERS,
    SECTIONS,
    Config,
    DataConfig,
    DebugConfig,
    LoggingConfig,
    ModelConfig,
    SystemConfig,
    TrainingConfig,
)
from gpuherd.config.validate import validate
from gpuherd.errors import ConfigError

__all__ = [
    "BUILTIN_DATASETS", "BUILTIN_TOKENIZERS", "DEFAULT_PRESET", "PRESETS", "SECTIONS", "Config", "ConfigError",
    "DataConfig", "DebugConfig", "is_glob", "LoggingConfig", "ModelConfig", "SystemConfig", "TrainingConfig", "parse_value", "preset",
    "read_json_file", "resolve", "validate",
]
