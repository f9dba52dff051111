"""Frozen dataclass configs from parsed JSON, checked field by field against their type annotations, with
the bounds helpers their __post_init__ methods use: a wrong type or value is one ConfigError naming the
field (`model.moe.router.kind`, say), never a crash later. moe_serve.model_config is its user."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
import typing
from typing import Any

from moe_serve.errors import ConfigError

logger = logging.getLogger(__name__)


def check_choice(name: str, value: Any, choices: Any) -> None:
    """value must be one of `choices`: a tuple of names, or a Literal type (the one spelling of an enumeration)."""
    if typing.get_origin(choices) is typing.Literal:
        choices = typing.get_args(choices)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_size(name: str, value: Any, maximum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= maximum:
        raise ConfigError(f"{name} must be an integer between 1 and {maximum}; got {value!r}")


def check_float(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    if not (low < value if low_open else low <= value) or not value <= high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ConfigError(f"{name} must be in {interval}; got {value!r}")


def build(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from parsed JSON, checking every value against its field's annotation (JSON
    lists become tuples, nested objects nested configs), so that a wrong-typed field is one clear
    ConfigError naming it, never a crash later."""
    if isinstance(data, cls):
        return data
    variant = getattr(cls, "config_variant", None)
    if variant is not None:  # a family of configs told apart by a field (a router kind's own settings)
        cls, data = variant(data, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be an object; got {_json_type(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(key) for key in set(data) - names)
    if unknown:
        logger.warning("ignoring unknown config keys in %s: %s", where, ", ".join(unknown))
    kwargs = {key: _convert(value, hints[key], f"{where}.{key}") for key, value in data.items() if key in names}
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise ConfigError(f"{where}: missing required field '{missing[0]}'")
    return cls(**kwargs)


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:  # the first alternative whose JSON shape matches (int | tuple[int, ...])
            if _shape_matches(value, option):
                return _convert(value, option, where)
        raise ConfigError(f"{where} must be {' or '.join(_describe(a) for a in args)}; got {_shown(value)}")
    if origin is typing.Literal:
        if not any(value == a and type(value) is type(a) for a in args):
            raise ConfigError(f"{where} must be one of {', '.join(map(str, args))}; got {_shown(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be {_describe(hint)}; got {_shown(value)}")
        return tuple(_convert(item, args[0], f"{where}[{i}]") for i, item in enumerate(value))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if not _shape_matches(value, hint):
        raise ConfigError(f"{where} must be {_describe(hint)}; got {_shown(value)}")
    if hint is float:
        if not math.isfinite(value):
            raise ConfigError(f"{where} must be a finite number; got {value!r}")
        return float(value)
    return value


def _shape_matches(value: Any, hint: Any) -> bool:
    """Whether a JSON value has the kind `hint` asks for (bool is not an int here; an int is a float)."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        return isinstance(value, (list, tuple))
    if origin is typing.Literal:
        return isinstance(value, str)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict) or (isinstance(hint, type) and isinstance(value, hint))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(args[0], "values")
        return f"a list of {plural}"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if dataclasses.is_dataclass(hint):
        return "an object"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}.get(
        hint, str(hint)
    )


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number"
    )


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else repr(value)
    return f"{_json_type(value)} ({text[:60]}{'…' if len(text) > 60 else ''})"


def to_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value
