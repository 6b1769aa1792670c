"""Writing partial, nested or dotted values into a config, each checked against its field.

Unknown sections and keys are named with the closest valid one, including a key
put in the wrong section (`system.grad_accum_nums` -> `training.grad_accum_nums`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from gpuherd.config.coerce import coerce
from gpuherd.errors import ConfigError
from gpuherd.text import did_you_mean


def section_names(cfg: Any) -> tuple[str, ...]:
    """The nested sections of a config: every field that is itself a dataclass."""
    return tuple(f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name)))


def merge(cfg: Any, raw: dict[str, Any], source: str) -> None:
    """`{"section": {"key": value}}` into `cfg`, in place."""
    for section_name, values in raw.items():
        section = _section(cfg, section_name, source)
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: section '{section_name}' must be an object")
        for key, value in values.items():
            _assign(cfg, section, section_name, key, value, source)


def set_dotted(cfg: Any, dotted: str, value: Any, source: str) -> None:
    """`section.key` = value into `cfg`, in place."""
    section_name, _, key = dotted.partition(".")
    if not key:
        hint = _suggest_key(cfg, "system", dotted) if dotted else ""
        sections = ", ".join(section_names(cfg))
        raise ConfigError(f"{source}: '{dotted}' must be section.key{hint or ' (sections: ' + sections + ')'}")
    _assign(cfg, _section(cfg, section_name, source), section_name, key, value, source)


def _section(cfg: Any, name: str, source: str) -> Any:
    sections = section_names(cfg)
    if name not in sections:
        raise ConfigError(
            f"{source}: unknown section '{name}'{did_you_mean(name, sections)}; sections: {', '.join(sections)}"
        )
    return getattr(cfg, name)


def _assign(cfg: Any, section: Any, section_name: str, key: str, value: Any, source: str) -> None:
    hints = typing.get_type_hints(type(section))
    if key not in hints:
        raise ConfigError(
            f"{source}: unknown key '{section_name}.{key}'{_suggest_key(cfg, section_name, key)}"
        )
    setattr(section, key, coerce(value, hints[key], f"{section_name}.{key}", source))


def _suggest_key(cfg: Any, section_name: str, key: str) -> str:
    """Closest key in the same section, else anywhere (a key put in the wrong section)."""
    here = [f.name for f in dataclasses.fields(getattr(cfg, section_name))]
    match = difflib.get_close_matches(key, here, n=1, cutoff=0.6)
    if match:
        return f" (did you mean '{section_name}.{match[0]}'?)"
    everywhere = {
        f"{s}.{f.name}": f.name for s in section_names(cfg) for f in dataclasses.fields(getattr(cfg, s))
    }
    for dotted, name in everywhere.items():
        if name == key:
            return f" (did you mean '{dotted}'?)"
    match = difflib.get_close_matches(key, list(everywhere.values()), n=1, cutoff=0.6)
    if match:
        dotted = next(d for d, n in everywhere.items() if n == match[0])
        return f" (did you mean '{dotted}'?)"
    return ""
