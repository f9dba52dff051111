"""`option()`: a dataclass field that the command line offers as `--name-with-dashes`, with its help.
Defaults are written once, in the dataclass; moe_serve.cli derives its options from these fields."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any = None, help: str = "", *, factory: Any = None, **metadata: Any) -> Any:
    """metadata: `cli=False` hides the field from the command line, `choices` limits its values, `flags`
    gives extra spellings (e.g. ("-k",)), `action="append"` collects a repeatable option into a list."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help, **metadata})
    return field(default=default, metadata={"help": help, **metadata})
