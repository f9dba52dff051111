"""Command-line options derived from config dataclasses (each field's default and help written once, in
the dataclass, via moe_serve.options.option), and the parsing of option values shared by commands."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from moe_serve.errors import ValidationError
from moe_serve.moe_policy import AUTO

_TYPES = {"int": int, "float": float, "str": str}


def add_options(parser: argparse.ArgumentParser | Any, cls: type, *, prefix: str = "") -> None:
    """One `--field-name` per field of `cls` that has help metadata (and not cli=False)."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if "help" not in meta or meta.get("cli") is False:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *meta.get("flags", ())]
        kwargs: dict[str, Any] = {"dest": prefix + f.name, "help": meta["help"], "default": argparse.SUPPRESS}
        base = str(f.type).replace(" | None", "")
        if "nargs" in meta:
            kwargs.update(nargs=meta["nargs"], const=meta.get("const"), metavar=meta.get("metavar"))
        elif meta.get("action") == "append":
            kwargs["action"] = "append"
        elif base == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _PARSERS.get(meta.get("type", "")) or _TYPES.get(base, str)
            kwargs["choices"] = meta.get("choices")
            kwargs["metavar"] = f.name.upper()
        default = f.default if f.default is not dataclasses.MISSING else None
        if default not in (None, [], ()) and base != "bool":
            kwargs["help"] += f" (default: {default})"
        parser.add_argument(*flags, **kwargs)


def from_options(cls: type, args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> Any:
    """Build `cls` from the options the user gave (the dataclass supplies every other default)."""
    given = {f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls) if hasattr(args, prefix + f.name)}
    return cls(**{**given, **overrides})


def int_list(text: str | None, name: str) -> list[int] | None:
    """'1,2,4' -> [1, 2, 4]; the error names the option."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValidationError(f"--{name} must be comma-separated integers, got {text!r}", parameter=name) from None


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1000**3,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1073741824' -> bytes."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GB, 1073741824)")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_k(text: str) -> int | str:
    """A request's k on the command line: a number of experts, or "auto" (the server's latency target)."""
    if text == AUTO:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f'not a k: {text!r} (a number of experts, or "auto")') from None


_PARSERS = {"size": parse_size, "k": parse_k}
