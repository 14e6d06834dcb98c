"""The one set of value checks: each error names the value and the bound it broke."""

from __future__ import annotations

import math
from typing import Any, TypeGuard, TypeVar

import numpy as np

#: How much of a value's repr an error quotes.
SHOW = 80

T = TypeVar("T")


def show(value: Any) -> str:
    """`value` as an error message quotes it: its repr, cut at 80 characters."""
    text = repr(value)
    return text if len(text) <= SHOW else f"{text[:SHOW - 3]}..."


def is_int(value: Any) -> TypeGuard[int]:
    """Whether `value` is a Python int and not a bool: what JSON, SQLite and the journal hold.

    NOTE: a numpy integer is not one here; values that come from a user go through
    :func:`check_int`, which takes numpy integers and returns a Python int.
    """
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, lo: int | None, hi: int | None = None, error: type[Exception] = ValueError,
              *, type_error: type[Exception] | None = None, why: str = "") -> int:
    """Returns `value` as an int after checking ``lo <= value < hi``.

    Args:
        name: The value's name in the error.
        value: The value (a Python or numpy integer; a bool is not an int here).
        lo: The least value allowed; None: no lower bound.
        hi: One past the largest value allowed; None: no upper bound.
        error: What a value out of range raises.
        type_error: What a value that is not an int raises; default TypeError when `error` is
            ValueError, else `error` (a protocol error stays one exception).
        why: Why the bound is what it is, said after the value when it is out of range.

    Raises:
        TypeError: `value` is not an int (or `type_error` / `error`, as above).
        ValueError: `value` is out of range, or `error` when given.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        wrong = type_error or (TypeError if error is ValueError else error)
        raise wrong(f"{name} must be an int (got {name}={show(value)})")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        if lo is None:
            bound = f"< {hi}"
        elif hi is None:
            bound = f">= {lo}"
        else:
            bound = f"in [{lo}, {hi})"
        raise error(f"{name} must be {bound} (got {name}={value}){': ' if why else ''}{why}")
    return int(value)


def check_int_text(name: str, text: str, lo: int | None, hi: int | None = None) -> int:
    """Returns `text` read as a decimal int (a query's or a file's value) after checking ``lo <= value < hi``.

    Raises:
        ValueError: `text` is not a decimal int, or the value is out of range.
    """
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an int (got {name}={show(text)})") from None
    return check_int(name, value, lo, hi)


def check_seconds(name: str, value: Any, error: type[Exception] = ValueError) -> float:
    """Returns `value` as a float after checking it is a finite number of seconds > 0.

    Raises:
        TypeError: `value` is not an int or a float (a bool is neither here).
        ValueError: `value` is not > 0 or not finite, or `error` when given.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number of seconds (got {name}={show(value)})")
    if not value > 0:
        raise error(f"{name} must be > 0 seconds (got {name}={value!r})")
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number of seconds (got {name}={value!r})")
    return float(value)


def check_count(name: str, values: Any, expected: int, what: str, error: type[Exception] = ValueError) -> None:
    """Checks that `values` has one item for each of `expected` things called `what` (plural).

    Example: ``check_count("weights", [1, 2, 3], 2, "sources")`` raises "the job has 2 sources;
    3 weights given".

    Raises:
        ValueError: the lengths differ, or `error` when given.
    """
    if len(values) != expected:
        raise error(f"the job has {expected} {what}; {len(values)} {name} given")


def check_choice(name: str, value: Any, choices: tuple[T, ...], why: str = "") -> T:
    """Returns the one of `choices` that `value` equals; ValueError names both (and `why`) otherwise."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)} (got {name}={show(value)}){': ' if why else ''}{why}")
    return choices[choices.index(value)]


def check_name(name: str, value: Any, max_len: int, error: type[Exception] = ValueError) -> str:
    """Returns `value` after checking it is a non-empty string of at most `max_len` characters."""
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise error(f"{name} must be a non-empty string of at most {max_len} characters (got {name}={show(value)})")
    return value


def check_weights(weights: Any) -> list[float]:
    """Returns a mixture's weights as floats after checking there is at least one, each a finite number
    >= 0, and not all 0.

    Raises:
        ValueError: no weights, one not a number, negative or not finite, or all 0 (the message names it).
    """
    try:
        w = np.array(weights, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ValueError(f"weights must be numbers (got {show(list(weights))})") from None
    if not w.size:
        raise ValueError("a mixture needs at least one source")
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"weight {weights[i]!r} of source {i} must be finite and >= 0")
    ws: list[float] = w.tolist()
    if not sum(ws) > 0:
        raise ValueError(f"weights {show(list(weights))} add up to {sum(ws)}: at least one must be > 0")
    return ws


def check_type(name: str, value: Any, kind: type[T], error: type[Exception] = TypeError) -> T:
    """Returns `value` after checking it is a `kind` (a bool is no int here); `error` (TypeError) names both
    otherwise (a file's content that is of the wrong type stays a ValueError of its reader)."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise error(f"{name} must be of type {kind.__name__} (got {type(value).__name__})")
    return value


def check_bool(name: str, value: Any) -> bool:
    """Returns `value` after checking it is a bool; TypeError names it otherwise."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (got {name}={show(value)})")
    return value
