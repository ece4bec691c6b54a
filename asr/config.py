"""Typed configuration: frozen dataclasses loaded from YAML, with `section.key=value` overrides.

Each part of the toolkit owns its own config dataclass (the model's `ModelConfig`, the data
pipeline's `DataConfig`, ...); an experiment's config is a dataclass whose fields are those
sections. This module only knows how to turn YAML into such dataclasses, strictly:

    cfg = load_config(ExperimentConfig, "conf/synth.yaml", ["training.lr=1e-3"])

An unknown key, a missing required key or a value of the wrong type is a ConfigError naming the
file and the dotted key. Imports nothing of ours.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")

__all__ = ["ConfigError", "from_dict", "to_dict", "load_config", "parse_overrides", "config_diff"]


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names file and key."""


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, source: str = "config", prefix: str = "") -> T:
    """Build dataclass `cls` from a plain mapping, checking every key and type.

    `source` (usually the YAML path) and `prefix` (the dotted path of this section) appear in
    errors. Missing keys take the dataclass defaults; a missing key without default is an error.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: '{prefix.rstrip('.') or '<top>'}' must be a mapping, got {_kind(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{source}: unknown key '{prefix}{unknown[0]}' (known: {known})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        key = prefix + name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], source, key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing required key '{key}'")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{source}: {prefix.rstrip('.') or cls.__name__}: {e}") from None


def _kind(value: Any) -> str:
    return type(value).__name__


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    """Check `value` against type hint `tp`, converting lists to tuples and ints to floats."""
    if isinstance(value, _Override):  # a command-line value: its text for a str field, else as YAML
        if tp is str:
            return value.text
        value = value.parsed
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(typing.get_args(tp), value, source, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source=source, prefix=key + ".")
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{source}: '{key}' must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        return _convert_sequence(tp, value, source, key)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{source}: '{key}' must be a mapping, got {_kind(value)}")
        return dict(value)
    return _convert_scalar(tp, value, source, key)


def _convert_union(args: tuple, value: Any, source: str, key: str) -> Any:
    """`value` as the first of a Union's members that takes it (None when the Union allows it)."""
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in (a for a in args if a is not type(None)):
        try:
            return _convert(arg, value, source, key)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{source}: '{key}' has the wrong type ({_kind(value)})")


def _convert_sequence(tp: Any, value: Any, source: str, key: str) -> list | tuple:
    """A list or tuple hint: each item checked (a fixed-length tuple's by position)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{source}: '{key}' must be a list, got {_kind(value)}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],)
    if origin is tuple and args and len(args) != 1:
        if len(value) != len(args):
            raise ConfigError(f"{source}: '{key}' must have {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, source, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item = args[0] if args else Any
    items = [_convert(item, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple or tp is tuple else items


def _convert_scalar(tp: Any, value: Any, source: str, key: str) -> Any:
    """A number, bool, string or other plain type: ints become floats where a float is asked for."""
    if tp is float:
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads "1e-3" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: '{key}' must be a number, got {_kind(value)} {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: '{key}' must be an integer, got {_kind(value)} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: '{key}' must be true or false, got {_kind(value)} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: '{key}' must be a string, got {_kind(value)} {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{source}: '{key}' must be {tp.__name__}, got {_kind(value)} {value!r}")
    return value


def to_dict(obj: Any) -> Any:
    """A dataclass (nested) as plain dicts/lists/scalars, fit for YAML, JSON and model files."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


@dataclasses.dataclass(frozen=True)
class _Override:
    text: str  # as typed
    parsed: Any  # as YAML reads it


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """["training.lr=1e-3", "data.specaug.time_masks=2"] -> nested dict; values parsed as YAML."""
    nested: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override '{item}': expected section.key=value")
        try:
            value = _Override(raw, yaml.safe_load(raw) if raw.strip() else "")
        except yaml.YAMLError:
            value = _Override(raw, raw)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{part}' is set to a value and used as a section")
        node[leaf] = value
    return nested


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        else:
            out[k] = v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file holding a mapping; ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def load_config(cls: type[T], path: str | Path | None, overrides: Sequence[str] = (),
                values: Mapping[str, Any] | None = None) -> T:
    """Load dataclass `cls` from a YAML file (None: defaults only), then apply key=value overrides,
    then `values` (top-level fields, already typed: a command line's), checked together."""
    data = read_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "config"
    if overrides:
        data = _merge(data, parse_overrides(overrides))
        source += " (with overrides)"
    if values:
        data = {**data, **values}
        source += " (with the command line)"
    return from_dict(cls, data, source=source)


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Lines 'key: old -> new' for every dotted key whose value differs (plain dicts)."""
    lines = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            lines += config_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            lines.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return lines
