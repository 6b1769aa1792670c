"""The one typed configuration shared by supervisor, worker and dataset cache.

Sections follow seed 003 (`system`, `model`, `training`, `data`, `debug`).
A config is built as: preset -> `--config FILE.json` (partial, nested) ->
`--max-steps` -> `--set section.key=value`, then validated as a whole. Every
problem is a `ConfigError` with one line naming the culprit; callers turn it
into exit code 2 before anything is spawned or written.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

# Names the data section understands without a path on disk.
BUILTIN_DATASETS = ("shakespeare", "dummy")
BUILTIN_TOKENIZERS = ("gpt2", "byte")


class ConfigError(ValueError):
    """A config problem, phrased as one line for the user."""


@dataclass
class SystemConfig:
    device: str = "auto"  # auto | cuda | cpu
    device_id: int | None = None  # one physical GPU id (train_gpu.sh sets it)
    gpus: list[int] | None = None  # physical GPU ids to use; None = all allowed
    nproc: int = 2  # CPU workers on a machine with no GPU
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    seed: int = 1337
    run_root: str = "logs"  # run directories go to <run_root>/<run-id>/
    checkpoint_dir: str = ".checkpoints"
    isolate: bool = True  # each worker sees only its own GPU
    hang_timeout: float = 0.0  # fixed step allowance in seconds; 0 = learned per phase (hang_factor, hang_floor)
    startup_timeout: float = 0.0  # allowance for init + first step; 0 = default
    grace_period: float = 5.0  # SIGTERM -> SIGKILL wait during teardown
    rendezvous_timeout: float = 120.0  # process-group init
    log_ranks: list[int] | None = None  # console shows these ranks (+ all warnings)
    collapse_logs: bool = False  # identical lines from all ranks -> one line
    monitor_interval: float = 5.0  # seconds between GPU samples
    max_restarts: int = 0  # restart every worker after a failure, resuming from the newest checkpoint
    restart_backoff: float = 0.2  # seconds before the first restart; doubles for each further quick failure
    restart_on_nan: bool = False  # a NaN stop (exit 6) is restarted too, not only crashes and hangs
    # hang verdicts and stragglers (supervisor/health/): learned timeouts and slow-rank warnings
    hang_factor: float = 5.0  # learned allowance of a phase = max(hang_floor, hang_factor x p99 of its durations)
    hang_floor: float = 10.0  # seconds: a learned allowance is never shorter
    straggler_factor: float = 1.3  # compute per step this much above the other ranks' median: a straggler; 0 = off
    straggler_windows: int = 3  # ... in this many 5 s windows in a row before the warning


@dataclass
class ModelConfig:
    n_layers: int = 32
    dim: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = 8  # grouped-query attention; None = n_heads
    vocab_size: int = 0  # 0 = the tokenizer's, padded to a multiple of 64
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02
    tie_embeddings: bool = False
    attention: str = "auto"  # auto | flash_attn | sdpa | eager


@dataclass
class TrainingConfig:
    batch_size: int = 4  # micro-batch per worker
    grad_accum_nums: int = 8
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to learning_rate * this
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_steps: int = 10000
    warmup_steps: int = 2000
    max_grad_norm: float = 1.0  # 0 disables clipping
    use_amp: bool = True  # bf16 autocast on GPU (fp16 + scaler where no bf16)
    amp_dtype: str = "bf16"  # bf16 | fp16
    num_workers: int = 0  # data-loading processes per worker
    log_every: int = 10
    eval_every: int = 500  # 0 disables evaluation
    eval_steps: int = 20
    save_every: int = 1000  # 0 = only at the end
    keep_last: int = 3
    strategy: str = "auto"  # auto | single | ddp | fsdp | zero1 | deepspeed
    deepspeed_config: str | None = None
    fsdp_reshard_after_forward: bool = True  # True ~ ZeRO-3, False ~ ZeRO-2
    gradient_checkpointing: bool = False
    compile: bool = False
    resume: str | None = None  # None | "auto" | path to a checkpoint


@dataclass
class DataConfig:
    dataset: str = "shakespeare"  # shakespeare | dummy | path to text/dir/.jsonl
    tokenizer: str = "gpt2"  # gpt2 | byte | path to a tokenizer.json
    context_length: int = 2048
    num_samples: int = 0  # documents to use; 0 = all
    val_fraction: float = 0.05
    cache_dir: str = "cache/datasets"
    verify_cache: bool = False  # full checksum on every open


@dataclass
class DebugConfig:
    enabled: bool = False
    log_level: str = "INFO"  # TRACE | DEBUG | INFO | WARNING | ERROR
    nan_detection: bool = True  # cheap finite checks every step
    nan_hooks: bool = False  # forward hooks naming the first bad module
    nan_policy: str = "stop"  # stop | skip
    max_nan_skips: int = 3
    max_dump_mb: int = 1024


@dataclass
class Config:
    preset: str = "production"
    system: SystemConfig = field(default_factory=SystemConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Config:
        """Exact inverse of `to_dict` (a saved, resolved config); still validated."""
        cfg = cls(preset=str(raw.get("preset", "custom")))
        _merge(cfg, {k: v for k, v in raw.items() if k != "preset"}, source="saved config")
        return cfg

    @classmethod
    def load(cls, path: Path) -> Config:
        try:
            raw = orjson.loads(Path(path).read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read resolved config {path}: {exc}") from None
        return cls.from_dict(raw)


SECTIONS = ("system", "model", "training", "data", "debug")


# --------------------------------------------------------------------------- presets


def _debug() -> Config:
    """2 layers, 10 steps, debug logging, NaN hooks, conservative numerics."""
    cfg = Config(preset="debug")
    cfg.model = ModelConfig(n_layers=2, dim=128, n_heads=4, n_kv_heads=2, multiple_of=32)
    cfg.training = TrainingConfig(
        batch_size=4, grad_accum_nums=2, learning_rate=3e-4, max_steps=10, warmup_steps=2,
        use_amp=False, log_every=1, eval_every=5, eval_steps=2, save_every=0, keep_last=2,
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


PRESETS: dict[str, typing.Callable[[], Config]] = {
    "debug": _debug,
    "production": _production,
    "gpt2-small": _gpt2_small,
}
DEFAULT_PRESET = "production"  # as in seed 003: `pretrain_main.py` alone is production


def preset(name: str) -> Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(
            f"unknown preset '{name}'{_suggest(name, PRESETS)}; presets: {', '.join(PRESETS)}"
        ) from None


# --------------------------------------------------------------------------- building


def resolve(
    preset_name: str | None = None,
    config_file: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    max_steps: int | None = None,
    cwd: Path | None = None,
) -> Config:
    """Build, merge and validate a config; raises ConfigError with one line."""
    cwd = Path.cwd() if cwd is None else cwd
    cfg = preset(preset_name or DEFAULT_PRESET)
    if config_file is not None:
        _merge(cfg, read_json_file(_absolute(config_file, cwd)), source=str(config_file))
    if max_steps is not None:
        _set(cfg, "training.max_steps", max_steps, source="--max-steps")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects section.key=value, got '{item}'")
        _set(cfg, key.strip(), parse_value(text.strip()), source="--set")
    _absolutize_paths(cfg, cwd)
    validate(cfg)
    return cfg


def read_json_file(path: Path) -> dict[str, Any]:
    """A JSON config file; `//` and `/* */` comments are allowed (the seed's own
    single-GPU example carries them), trailing text is not."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        raw = orjson.loads(_strip_json_comments(text))
    except orjson.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: top level must be an object of sections")
    return raw


def parse_value(text: str) -> Any:
    """`--set` values: JSON when it parses (1e-4, true, null, [0,1]), else a string."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return text


def _merge(cfg: Config, raw: dict[str, Any], source: str) -> None:
    for section_name, values in raw.items():
        section = _section(cfg, section_name, source)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section_name}' must be an object")
        for key, value in values.items():
            _assign(section, section_name, key, value, source)


def _set(cfg: Config, dotted: str, value: Any, source: str) -> None:
    section_name, _, key = dotted.partition(".")
    if not key:
        hint = _suggest_key("system", dotted) if dotted else ""
        raise ConfigError(f"{source}: '{dotted}' must be section.key{hint or ' (sections: ' + ', '.join(SECTIONS) + ')'}")
    _assign(_section(cfg, section_name, source), section_name, key, value, source)


def _section(cfg: Config, name: str, source: str) -> Any:
    if name not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown section '{name}'{_suggest(name, SECTIONS)}; sections: {', '.join(SECTIONS)}"
        )
    return getattr(cfg, name)


def _assign(section: Any, section_name: str, key: str, value: Any, source: str) -> None:
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        raise ConfigError(
            f"{source}: unknown key '{section_name}.{key}'{_suggest_key(section_name, key)}"
        )
    setattr(section, key, _coerce(value, hints[key], f"{section_name}.{key}", source))


def _coerce(value: Any, annotation: Any, name: str, source: str) -> Any:
    """Check `value` against a field's annotation; ints widen to float, nothing else."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, name, source)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str) and item_type is int:  # "0,2" from a command line
            value = _int_list(value, name, source)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {name} must be a list, got {_show(value)}")
        return [_coerce(v, item_type, name, source) for v in value]
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {name} must be true or false, got {_show(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: {name} must be an integer, got {_show(value)}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{source}: {name} must be a number, got {_show(value)}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{source}: {name} must be a string, got {_show(value)}")
    raise TypeError(f"unsupported config annotation {annotation!r} for {name}")


def _int_list(text: str, name: str, source: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{source}: {name} must be a comma-separated list of integers, got '{text}'") from None


def _show(value: Any) -> str:
    kind = "null" if value is None else type(value).__name__
    return f"{kind} {value!r}"


def _suggest(word: str, choices: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _suggest_key(section_name: str, key: str) -> str:
    """Closest key in the same section, else anywhere (a key put in the wrong section)."""
    here = [f.name for f in dataclasses.fields(getattr(Config(), section_name))]
    match = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    if match:
        return f" (did you mean '{section_name}.{match[0]}'?)"
    everywhere = {
        f"{s}.{f.name}": f.name for s in SECTIONS for f in dataclasses.fields(getattr(Config(), s))
    }
    for dotted, name in everywhere.items():
        if name == key:
            return f" (did you mean '{dotted}'?)"
    match = difflib.get_close_matches(key, list(everywhere.values()), n=1, cutoff=0.6)
    if match:
        dotted = next(d for d, n in everywhere.items() if n == match[0])
        return f" (did you mean '{dotted}'?)"
    return ""


def _absolute(path: str | Path, cwd: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (cwd / p)


def _absolutize_paths(cfg: Config, cwd: Path) -> None:
    """Paths a user typed are relative to where they ran the command; store them
    absolute so workers (and later resumes) read the same files."""
    cfg.system.run_root = str(_absolute(cfg.system.run_root, cwd))
    cfg.system.checkpoint_dir = str(_absolute(cfg.system.checkpoint_dir, cwd))
    cfg.data.cache_dir = str(_absolute(cfg.data.cache_dir, cwd))
    if cfg.data.dataset not in BUILTIN_DATASETS:
        cfg.data.dataset = str(_absolute(cfg.data.dataset, cwd))
    if cfg.data.tokenizer not in BUILTIN_TOKENIZERS:
        cfg.data.tokenizer = str(_absolute(cfg.data.tokenizer, cwd))
    if cfg.training.deepspeed_config:
        cfg.training.deepspeed_config = str(_absolute(cfg.training.deepspeed_config, cwd))
    if cfg.training.resume not in (None, "auto"):
        cfg.training.resume = str(_absolute(cfg.training.resume, cwd))


# --------------------------------------------------------------------------- validation

_CHOICES = {
    "system.device": ("auto", "cuda", "cpu"),
    "system.backend": ("auto", "nccl", "gloo"),
    "model.attention": ("auto", "flash_attn", "sdpa", "eager"),
    "training.amp_dtype": ("bf16", "fp16"),
    "training.strategy": ("auto", "single", "ddp", "fsdp", "zero1", "deepspeed"),
    "debug.log_level": ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR"),
    "debug.nan_policy": ("stop", "skip"),
}
_POSITIVE = (
    "system.nproc", "model.n_layers", "model.dim", "model.n_heads", "model.multiple_of",
    "model.norm_eps", "model.rope_theta", "model.init_std", "training.batch_size",
    "training.grad_accum_nums", "training.learning_rate", "training.max_steps",
    "training.log_every", "training.eval_steps", "training.keep_last", "data.context_length",
    "debug.max_nan_skips", "debug.max_dump_mb", "system.grace_period",
    "system.rendezvous_timeout", "system.monitor_interval", "system.hang_floor", "system.straggler_windows",
)
_NON_NEGATIVE = (
    "model.vocab_size", "training.warmup_steps", "training.max_grad_norm",
    "training.weight_decay", "training.min_lr_ratio", "training.eps", "training.num_workers",
    "training.eval_every", "training.save_every", "data.num_samples", "system.seed",
    "system.hang_timeout", "system.startup_timeout", "system.max_restarts", "system.restart_backoff",
    "system.straggler_factor",
)


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def validate(cfg: Config) -> None:
    for dotted, choices in _CHOICES.items():
        value = _get(cfg, dotted)
        if value not in choices:
            raise ConfigError(f"{dotted} must be one of {', '.join(choices)}; got '{value}'{_suggest(str(value), choices)}")
    for dotted in _POSITIVE:
        if not _get(cfg, dotted) > 0:
            raise ConfigError(f"{dotted} must be > 0, got {_get(cfg, dotted)}")
    for dotted in _NON_NEGATIVE:
        if _get(cfg, dotted) < 0:
            raise ConfigError(f"{dotted} must be >= 0, got {_get(cfg, dotted)}")
    m, t, d, s = cfg.model, cfg.training, cfg.data, cfg.system
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads})")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"head dim model.dim/model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
    if m.n_kv_heads is not None and (m.n_kv_heads <= 0 or m.n_heads % m.n_kv_heads):
        raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
    if m.ffn_dim_multiplier is not None and m.ffn_dim_multiplier <= 0:
        raise ConfigError(f"model.ffn_dim_multiplier must be > 0, got {m.ffn_dim_multiplier}")
    if t.warmup_steps > t.max_steps:
        raise ConfigError(f"training.warmup_steps ({t.warmup_steps}) must not exceed training.max_steps ({t.max_steps})")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"training.min_lr_ratio must be within [0, 1], got {t.min_lr_ratio}")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(t, name) < 1:
            raise ConfigError(f"training.{name} must be within [0, 1), got {getattr(t, name)}")
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be within (0, 1), got {d.val_fraction}")
    if t.strategy == "deepspeed" and not t.deepspeed_config:
        raise ConfigError("training.strategy=deepspeed needs training.deepspeed_config (a DeepSpeed JSON file)")
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
    if s.hang_factor < 1:
        raise ConfigError(f"system.hang_factor must be >= 1 (a multiple of the observed p99), got {s.hang_factor}")
    if 0 < s.straggler_factor <= 1:
        raise ConfigError(f"system.straggler_factor must be 0 (off) or > 1, got {s.straggler_factor}")
    if s.device_id is not None and s.device_id < 0:
        raise ConfigError(f"system.device_id must be >= 0, got {s.device_id}")
    for name in ("gpus", "log_ranks"):
        ids = getattr(s, name)
        if ids is not None:
            if any(i < 0 for i in ids):
                raise ConfigError(f"system.{name} must hold non-negative ids, got {ids}")
            if len(set(ids)) != len(ids):
                raise ConfigError(f"system.{name} lists an id twice: {ids}")


def _strip_json_comments(text: str) -> str:
    """Remove // and /* */ comments outside JSON strings, keeping line numbers."""
    out: list[str] = []
    i, n, in_string = 0, len(text), False
    while i < n:
        ch = text[i]
        if in_string:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("\n" * text.count("\n", i, end))
            i = end
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)
