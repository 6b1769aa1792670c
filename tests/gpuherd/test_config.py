"""The typed config: presets, merging order, and every class of invalid input."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpuherd.config import PRESETS, SECTIONS, Config, ConfigError, preset, resolve, validate


def test_debug_preset_matches_seed():
    cfg = resolve("debug")
    assert cfg.preset == "debug"
    assert cfg.model.n_layers == 2
    assert cfg.training.max_steps == 10
    assert cfg.debug.enabled and cfg.debug.log_level == "DEBUG"
    assert cfg.debug.nan_detection and cfg.debug.nan_hooks
    assert cfg.training.use_amp is False  # conservative numerics


def test_production_is_the_default_and_matches_seed():
    cfg = resolve()
    assert cfg.preset == "production"
    assert cfg.model.n_layers == 32
    assert cfg.training.max_steps == 10000


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_is_valid(name):
    cfg = resolve(name)
    assert cfg.model.dim % cfg.model.n_heads == 0


def test_gpt2_small_preset_is_about_124m_parameters():
    m = preset("gpt2-small").model
    vocab = 50304
    hidden = 256 * ((int(2 * 4 * m.dim / 3) + 255) // 256)
    per_layer = 4 * m.dim * m.dim + 3 * m.dim * hidden + 2 * m.dim
    total = vocab * m.dim + m.n_layers * per_layer + m.dim
    assert 110e6 < total < 140e6


def test_seed_config_file_shape_merges_on_top_of_preset(tmp_path: Path):
    path = tmp_path / "single_gpu.json"
    path.write_text(json.dumps({
        "system": {"device": "cuda", "device_id": 0},
        "training": {"batch_size": 4, "grad_accum_nums": 8},
    }))
    cfg = resolve("debug", config_file=path)
    assert cfg.system.device == "cuda" and cfg.system.device_id == 0
    assert cfg.training.batch_size == 4 and cfg.training.grad_accum_nums == 8
    assert cfg.model.n_layers == 2  # untouched keys keep the preset's values


def test_config_file_may_carry_comments_like_the_seed(tmp_path: Path):
    path = tmp_path / "c.json"
    path.write_text('{\n "training": {\n  "batch_size": 8,  // larger batch\n  /* less */ "grad_accum_nums": 4\n }\n}\n')
    cfg = resolve("debug", config_file=path)
    assert (cfg.training.batch_size, cfg.training.grad_accum_nums) == (8, 4)


def test_comment_markers_inside_strings_are_kept(tmp_path: Path):
    data = tmp_path / "a//b.txt"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("hello")
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"data": {"dataset": str(data)}}))
    assert resolve("debug", config_file=path).data.dataset == str(data)


def test_order_preset_file_max_steps_set(tmp_path: Path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"training": {"max_steps": 50, "learning_rate": 1e-3}}))
    cfg = resolve("debug", config_file=path, max_steps=20, overrides=["training.max_steps=30"])
    assert cfg.training.max_steps == 30
    assert cfg.training.learning_rate == 1e-3


@pytest.mark.parametrize(
    "item, field, expected",
    [
        ("training.learning_rate=1e-4", ("training", "learning_rate"), 1e-4),
        ("training.use_amp=true", ("training", "use_amp"), True),
        ("system.gpus=0,2", ("system", "gpus"), [0, 2]),
        ("system.gpus=[1,3]", ("system", "gpus"), [1, 3]),
        ("model.n_kv_heads=null", ("model", "n_kv_heads"), None),
        ("data.tokenizer=byte", ("data", "tokenizer"), "byte"),
        ("training.warmup_steps=1.0", ("training", "warmup_steps"), 1),
        ("training.max_grad_norm=1", ("training", "max_grad_norm"), 1.0),
    ],
)
def test_set_parses_values(item, field, expected):
    cfg = resolve("debug", overrides=[item])
    assert getattr(getattr(cfg, field[0]), field[1]) == expected


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        # unknown keys: named, with the closest valid one
        (["training.batchsize=3"], "unknown key 'training.batchsize' (did you mean 'training.batch_size'?)"),
        (["system.grad_accum_nums=3"], "did you mean 'training.grad_accum_nums'?"),
        (["trainig.max_steps=3"], "unknown section 'trainig' (did you mean 'training'?)"),
        (["batch_size=3"], "did you mean 'training.batch_size'?"),
        (["training.max_steps"], "--set expects section.key=value"),
        # wrong types
        (["training.use_amp=1"], "training.use_amp must be true or false, got int 1"),
        (["training.batch_size=four"], "training.batch_size must be an integer, got str 'four'"),
        (["training.learning_rate=true"], "training.learning_rate must be a number"),
        (["training.batch_size=2.5"], "training.batch_size must be an integer"),
        (["system.gpus=0,x"], "system.gpus must be a comma-separated list of integers"),
        # impossible values
        (["training.max_steps=-1"], "training.max_steps must be > 0, got -1"),
        (["training.batch_size=0"], "training.batch_size must be > 0"),
        (["model.dim=130"], "model.dim (130) must be divisible by model.n_heads (4)"),
        (["model.n_kv_heads=3"], "model.n_heads (4) must be a multiple of model.n_kv_heads (3)"),
        (["training.warmup_steps=11"], "training.warmup_steps (11) must not exceed training.max_steps (10)"),
        (["training.strategy=fsdp2"], "training.strategy must be one of"),
        (["debug.nan_policy=ignore"], "debug.nan_policy must be one of stop, skip"),
        (["data.val_fraction=0"], "data.val_fraction must be within (0, 1)"),
        (["system.gpus=[0,0]"], "lists an id twice"),
        # missing files
        (["data.dataset=no/such/corpus.txt"], "data.dataset"),
        (["data.tokenizer=no/such/tokenizer.json"], "data.tokenizer"),
        (["training.resume=no/such.pt"], "training.resume checkpoint not found"),
        (["training.strategy=deepspeed"], "needs training.deepspeed_config"),
    ],
)
def test_invalid_config_is_one_clear_line(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        resolve("debug", overrides=overrides)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_every_integer_is_64_bit_bounded_wherever_it_was_set():
    """Past 2**63 orjson, torch and numpy fail with tracebacks; the config says so first,
    for fields without declared limits too (n_kv_heads) and for list items."""
    top = 2**63 - 1
    assert resolve("debug", overrides=[f"system.seed={top}"]).system.seed == top
    for dotted in ("system.seed", "training.max_steps", "debug.max_dump_mb"):
        with pytest.raises(ConfigError, match=f"^{dotted} must fit in a signed 64-bit integer"):
            resolve("debug", overrides=[f"{dotted}={top + 1}"])
    cfg = resolve("debug")
    cfg.model.n_kv_heads = 10**30
    with pytest.raises(ConfigError, match="^model.n_kv_heads must fit in a signed 64-bit integer"):
        validate(cfg)
    cfg = resolve("debug")
    cfg.system.gpus = [0, 2**64]
    with pytest.raises(ConfigError, match="^system.gpus must fit in a signed 64-bit integer"):
        validate(cfg)
    cfg.system.gpus = [0, 10**400]
    with pytest.raises(ConfigError, match="got a 1329-bit number$"):  # never a 400-digit line
        validate(cfg)


@pytest.mark.parametrize("dotted, impossible", [
    ("model.dim", 2**40), ("model.n_layers", 100_000_000), ("model.n_heads", 4096),
    ("model.vocab_size", 2**30), ("data.context_length", 2**30), ("model.ffn_dim_multiplier", 1e6),
])
def test_impossible_model_sizes_are_refused(dotted, impossible):
    with pytest.raises(ConfigError, match=f"^{dotted} must be within "):
        resolve("debug", overrides=[f"{dotted}={impossible}"])


def test_a_saved_config_is_validated_like_a_typed_one():
    raw = resolve("debug").to_dict()
    raw["model"]["dim"] = 10**25
    with pytest.raises(ConfigError, match="model.dim must fit in a signed 64-bit integer"):
        validate(Config.from_dict(raw))


def test_unknown_key_in_file_names_the_file(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"training": {"learning_rat": 1e-3}}))
    with pytest.raises(ConfigError, match=r"bad.json: unknown key 'training.learning_rat' \(did you mean 'training.learning_rate'\?\)"):
        resolve("debug", config_file=path)


def test_missing_and_malformed_config_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        resolve("debug", config_file=tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"training": {"batch_size": 4,}}')
    with pytest.raises(ConfigError, match=r"invalid JSON at line 1 column"):
        resolve("debug", config_file=bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="top level must be an object"):
        resolve("debug", config_file=bad)
    bad.write_text('{"training": 3}')
    with pytest.raises(ConfigError, match="section 'training' must be an object"):
        resolve("debug", config_file=bad)


def test_unknown_preset_suggests():
    with pytest.raises(ConfigError, match=r"unknown preset 'debg' \(did you mean 'debug'\?\)"):
        resolve("debg")


def test_user_paths_are_relative_to_cwd_and_stored_absolute(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text")
    cfg = resolve("debug", overrides=["data.dataset=corpus.txt"], cwd=tmp_path)
    assert cfg.data.dataset == str(corpus)
    assert cfg.system.run_root == str(tmp_path / "logs")
    assert cfg.data.cache_dir == str(tmp_path / "cache" / "datasets")


def test_saved_config_round_trips(tmp_path: Path):
    cfg = resolve("debug", overrides=["system.gpus=1,2", "training.learning_rate=2e-4"])
    path = tmp_path / "config.json"
    path.write_bytes(cfg.to_json())
    assert Config.load(path) == cfg


def test_every_field_has_a_documented_section():
    for name in SECTIONS:
        section = getattr(Config(), name)
        assert dataclasses.is_dataclass(section)
