"""Checking one value against its field's annotation: ints widen to float, nothing else."""

from __future__ import annotations

import types
import typing
from typing import Any

from gpuherd.errors import ConfigError
from gpuherd.text import int_list


def coerce(value: Any, annotation: Any, name: str, source: str) -> Any:
    """`value` as the annotated type, or a ConfigError naming `name` and `source`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(value, typing.get_args(annotation), name, source)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if isinstance(value, str) and item_type is int:  # "0,2" from a command line
            value = _int_list(value, name, source)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {name} must be a list, got {show(value)}")
        return [coerce(v, item_type, name, source) for v in value]
    if origin is dict:  # a free-form object (data.mix entries): checked by its section's own rules
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{source}: {name} must be an object, got {show(value)}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {name} must be true or false, got {show(value)}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{source}: {name} must be an integer, got {show(value)}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{source}: {name} must be a number, got {show(value)}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{source}: {name} must be a string, got {show(value)}")
    raise TypeError(f"unsupported config annotation {annotation!r} for {name}")


def _coerce_union(value: Any, options: tuple[Any, ...], name: str, source: str) -> Any:
    if value is None and type(None) in options:
        return None
    errors = []
    for option in (o for o in options if o is not type(None)):
        try:
            return coerce(value, option, name, source)
        except ConfigError as exc:
            errors.append(exc)
    raise errors[0]


def _int_list(text: str, name: str, source: str) -> list[int]:
    try:
        return int_list(text)
    except ValueError:
        raise ConfigError(f"{source}: {name} must be a comma-separated list of integers, got '{text}'") from None


def show(value: Any) -> str:
    kind = "null" if value is None else type(value).__name__
    return f"{kind} {value!r}"
