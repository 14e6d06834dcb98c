"""The one set of value checks: each error names the value and the bound it broke."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(name: str, value: Any, lo: int, hi: int | None = None, error: type[Exception] = ValueError) -> int:
    """Returns `value` as an int after checking ``lo <= value < hi`` (no upper bound when `hi` is None).

    Raises:
        TypeError: `value` is not an int (a bool is not an int here), unless `error` is given, then `error`.
        ValueError: `value` is out of range, or `error` when given.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise (TypeError if error is ValueError else error)(f"{name} must be an int (got {name}={value!r})")
    if value < lo or (hi is not None and value >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise error(f"{name} must be {bound} (got {name}={value})")
    return int(value)


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Returns `value` after checking it is one of `choices`; ValueError names both otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)} (got {name}={value!r})")
    return str(value)


def check_name(name: str, value: Any, max_len: int, error: type[Exception] = ValueError) -> str:
    """Returns `value` after checking it is a non-empty string of at most `max_len` characters."""
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise error(f"{name} must be a non-empty string of at most {max_len} characters (got {name}={value!r})")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Returns `value` after checking it is a bool; TypeError names it otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (got {name}={value!r})")
    return value
