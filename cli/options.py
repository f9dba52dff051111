"""Command-line options derived from config dataclasses (each field's default and help written once, in
the dataclass, via moe_serve.options.option), and the parsing of option values shared by commands."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from moe_serve.errors import ValidationError

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
            kwargs["type"] = _TYPES.get(base, str)
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
