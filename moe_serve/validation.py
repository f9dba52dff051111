"""Range checks that name the offending parameter: one owner for the messages every layer shows (the
engine's invariants, server settings, artifact configs)."""

from __future__ import annotations

import math
from typing import Any

from moe_serve.errors import ValidationError


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    """Raise ValidationError unless `value` is an int (not a bool) in [low, high]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(f"{name} must be an integer, got {value!r}", parameter=name, value=value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValidationError(f"{name} must be {bound}, got {value}", parameter=name, value=value)


def check_number(name: str, value: Any, low: float, high: float | None = None) -> None:
    """Raise ValidationError unless `value` is a finite int or float (not a bool) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{name} must be a number, got {value!r}", parameter=name, value=value)
    if not math.isfinite(value):
        raise ValidationError(f"{name} must be a finite number, got {value}", parameter=name, value=value)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValidationError(f"{name} must be {bound}, got {value}", parameter=name, value=value)
