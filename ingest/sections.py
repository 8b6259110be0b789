"""Typed configuration sections read from TOML: dataclasses whose fields are the keys, checked
as they are read, with errors that name the key (``train.batch_size: expected an integer,
got 'x'``). The training config and the import spec are both built this way."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


def _key(f: dataclasses.Field) -> str:
    """A field's key in the config file (its name, or its ``key`` alias: ``async``)."""
    return f.metadata.get("key", f.name)


def to_dict(config: Any) -> dict[str, Any]:
    """A section (dataclass) as TOML would write it (:func:`build_section` reads it back)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[_key(f)] = to_dict(value) if dataclasses.is_dataclass(value) else _plain(value)
    return out


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def build_section(kind: type, obj: Any, where: str, error: type[Exception]) -> Any:
    """``kind`` (a dataclass of sections and typed keys) from a TOML table ``obj``; a
    missing key keeps its default; an unknown key or a value of the wrong type raises
    ``error`` naming the key (``where`` prefixes it)."""
    if not isinstance(obj, dict):
        raise error(f"{where.rstrip('.') or 'config'}: expected a table of keys, got {obj!r}")
    hints = typing.get_type_hints(kind)
    fields = {_key(f): f.name for f in dataclasses.fields(kind)}
    for key in obj:
        if key not in fields:
            raise error(f"unknown key '{where}{key}'; known keys: {', '.join(sorted(fields))}")
    values = {}
    for key, raw in obj.items():
        values[fields[key]] = _convert(hints[fields[key]], raw, f"{where}{key}", error)
    return kind(**values)


def _convert(hint: Any, raw: Any, key: str, error: type[Exception]) -> Any:
    if dataclasses.is_dataclass(hint):
        return build_section(hint, raw, key + ".", error)
    origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(raw, list):
            raise error(f"{key}: expected a list, got {raw!r}")
        return [_convert(item, x, f"{key}[{i}]", error) for i, x in enumerate(raw)]
    if origin is dict:
        _, item = typing.get_args(hint)
        if not isinstance(raw, dict):
            raise error(f"{key}: expected a table of keys, got {raw!r}")
        return {str(k): _convert(item, v, f"{key}.{k}", error) for k, v in raw.items()}
    if origin in (typing.Union, types.UnionType):
        raise error(f"{key}: unsupported config type {hint}")
    if hint is bool:
        if not isinstance(raw, bool):
            raise error(f"{key}: expected true or false, got {raw!r}")
        return raw
    if hint is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise error(f"{key}: expected an integer, got {raw!r}")
        return raw
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise error(f"{key}: expected a number, got {raw!r}")
        if not math.isfinite(raw):
            raise error(f"{key}: expected a finite number, got {raw}")
        return float(raw)
    if hint is str:
        if not isinstance(raw, str):
            raise error(f"{key}: expected a string, got {raw!r}")
        return raw
    raise error(f"{key}: unsupported config type {hint}")
