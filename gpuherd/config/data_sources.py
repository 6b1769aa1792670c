"""The data section's sources: `data.dataset` (a built-in, a file, a directory or a glob),
`data.text_field` and `data.mix`, checked without reading file content (the dataset
cache reads the files and reports bad records, exit 3)."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

from gpuherd.config.coerce import show as _show
from gpuherd.config.paths import absolute
from gpuherd.config.schema import BUILTIN_DATASETS, DataConfig
from gpuherd.errors import ConfigError
from gpuherd.text import did_you_mean


MIX_ROLES = ("weight", "epochs", "held_out")  # share of training samples | passes over the source | validation only
MIX_KEYS = ("source", *MIX_ROLES, "text_field")


def is_glob(spec: str) -> bool:
    return any(ch in spec for ch in "*?[")


def absolutize_data_sources(d: DataConfig, cwd: Path) -> None:
    """Relative dataset paths and globs are relative to where the command ran."""
    if d.dataset not in BUILTIN_DATASETS:
        d.dataset = str(absolute(d.dataset, cwd))
    for entry in d.mix or []:
        source = entry.get("source") if isinstance(entry, dict) else None
        if isinstance(source, str) and source and source not in BUILTIN_DATASETS:
            entry["source"] = str(absolute(source, cwd))


def validate_data_sources(d: DataConfig) -> None:
    _check_text_field(d.text_field, "data.text_field")
    if d.mix is None:
        _check_source(d.dataset, "data.dataset")
        return
    if not d.mix:
        raise ConfigError("data.mix is empty: list {source, weight} entries, or leave it null to train on data.dataset")
    kinds: set[str] = set()
    sources: set[str] = set()
    for i, entry in enumerate(d.mix):
        where = f"data.mix[{i}]"
        for key in entry:
            if key not in MIX_KEYS:
                raise ConfigError(f"{where}: unknown key '{key}'{did_you_mean(key, MIX_KEYS)}; keys: {', '.join(MIX_KEYS)}")
        source = entry.get("source")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"{where}.source must be a path, a glob or a built-in dataset; got {_show(source)}")
        _check_source(source, f"{where}.source")
        if source in sources:
            raise ConfigError(f"{where}.source {source} is listed twice in data.mix")
        sources.add(source)
        if "text_field" in entry:
            _check_text_field(entry["text_field"], f"{where}.text_field")
        kinds.add(_mix_role(entry, where))
    kinds.discard("held_out")
    if not kinds:
        raise ConfigError("data.mix has only held_out sources: give at least one source a weight or epochs")
    if len(kinds) > 1:
        raise ConfigError("data.mix gives some sources a weight and others epochs: use one kind for every training source")


def _mix_role(entry: dict[str, Any], where: str) -> str:
    roles = [role for role in MIX_ROLES if role in entry]
    if len(roles) != 1:
        raise ConfigError(
            f"{where} needs exactly one of weight (share of training samples), epochs (passes over the source) "
            f"or held_out: true (validation only); got {', '.join(roles) or 'none'}"
        )
    role, value = roles[0], entry[roles[0]]
    if role == "held_out" and value is not True:
        raise ConfigError(f"{where}.held_out must be true (leave it out for a training source), got {_show(value)}")
    if role != "held_out" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ConfigError(f"{where}.{role} must be a number > 0, got {_show(value)}")
    return role


def _check_text_field(value: Any, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must name the key / column that holds the text, got {_show(value)}")


def _check_source(spec: str, name: str) -> None:
    if spec in BUILTIN_DATASETS:
        return
    if is_glob(spec):
        if not glob.glob(spec, recursive=True):
            raise ConfigError(f"{name} glob '{spec}' matches no file")
    elif not Path(spec).exists():
        raise ConfigError(f"{name} '{spec}' is neither a built-in ({', '.join(BUILTIN_DATASETS)}) nor an existing path")

