"""The one set of value checks (core/checks.py), and a guard that no other module writes its own."""

from __future__ import annotations

import ast
import math
import pathlib

import numpy as np
import pytest

from croupier.core.checks import (
    check_bool,
    check_choice,
    check_count,
    check_int,
    check_int_text,
    check_name,
    check_seconds,
    check_type,
    check_weights,
    is_int,
    show,
)
from croupier.core.errors import InvalidArgument

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("core", "server", "client", "tools", "harness", "demos", "integrations")


def test_check_int_returns_a_python_int_and_names_value_and_bound() -> None:
    assert check_int("n", np.int64(3), 0, 4) == 3 and type(check_int("n", np.int64(3), 0, 4)) is int
    assert check_int("n", -5, None) == -5
    with pytest.raises(ValueError, match=r"^n must be in \[0, 4\) \(got n=4\)$"):
        check_int("n", 4, 0, 4)
    with pytest.raises(ValueError, match=r"^n must be >= 1 \(got n=0\)$"):
        check_int("n", 0, 1)
    with pytest.raises(ValueError, match=r"^n must be < 3 \(got n=3\)$"):
        check_int("n", 3, None, 3)
    with pytest.raises(ValueError, match=r"^n must be < 3 \(got n=3\): a lease holds 2$"):
        check_int("n", 3, None, 3, why="a lease holds 2")
    for bad in (True, 1.0, "1", None):
        with pytest.raises(TypeError, match=rf"^n must be an int \(got n={bad!r}\)$"):
            check_int("n", bad, 0)


def test_check_int_raises_the_error_it_is_given() -> None:
    with pytest.raises(InvalidArgument, match="must be >= 0"):
        check_int("n", -1, 0, None, InvalidArgument)
    with pytest.raises(InvalidArgument, match="must be an int"):  # a protocol's error for both
        check_int("n", "x", 0, None, InvalidArgument)
    with pytest.raises(ValueError, match="must be an int") as info:  # a state's bad value is a ValueError
        check_int("n", "x", 0, type_error=ValueError)
    assert type(info.value) is ValueError


def test_check_int_text_reads_a_decimal_int_and_names_text_and_bound() -> None:
    assert check_int_text("limit", "25", 1, 101) == 25
    with pytest.raises(ValueError, match=r"^limit must be an int \(got limit='ten'\)$"):
        check_int_text("limit", "ten", 1, 101)
    with pytest.raises(ValueError, match=r"^limit must be in \[1, 101\) \(got limit=0\)$"):
        check_int_text("limit", "0", 1, 101)


def test_is_int_is_a_python_int_but_not_a_bool() -> None:
    assert is_int(0) and is_int(-(2**70))
    assert not any(is_int(v) for v in (True, False, 1.0, "1", None, np.int64(1)))


def test_check_seconds() -> None:
    assert check_seconds("t", 2) == 2.0 and check_seconds("t", np.float32(0.5)) == 0.5
    for bad in (0, -1.0, math.nan):
        with pytest.raises(ValueError, match=rf"^t must be > 0 seconds \(got t={bad!r}\)$"):
            check_seconds("t", bad)
    with pytest.raises(ValueError, match=r"^t must be a finite number of seconds \(got t=inf\)$"):
        check_seconds("t", math.inf)
    for wrong in (True, "1", None):
        with pytest.raises(TypeError, match=rf"^t must be a number of seconds \(got t={wrong!r}\)$"):
            check_seconds("t", wrong)


def test_check_weights_names_the_weight_and_its_source() -> None:
    assert check_weights([1, 0.5, 0]) == [1.0, 0.5, 0.0]
    for bad, match in ((["a"], r"^weights must be numbers \(got \['a'\]\)$"), ([], r"at least one source"),
                       ([1, -1], r"^weight -1 of source 1 must be finite and >= 0$"),
                       ([1, math.inf], r"^weight inf of source 1 must be finite and >= 0$"),
                       ([0, 0], r"^weights \[0, 0\] add up to 0.0: at least one must be > 0$")):
        with pytest.raises(ValueError, match=match):
            check_weights(bad)


def test_check_count_names_both_counts() -> None:
    check_count("weights", [1, 2], 2, "sources")
    with pytest.raises(ValueError, match=r"^the job has 2 sources; 3 weights given$"):
        check_count("weights", [1, 2, 3], 2, "sources")


def test_choice_name_bool_and_long_values() -> None:
    assert check_choice("tail", "pad", ("pad", "drop")) == "pad"
    assert check_choice("itemsize", 8, (4, 8)) == 8
    with pytest.raises(ValueError, match=r"^itemsize must be one of \[4, 8\] \(got itemsize=3\)$"):
        check_choice("itemsize", 3, (4, 8))
    with pytest.raises(ValueError, match=r"^tail must be one of \['pad', 'drop'\] \(got tail='x'\): why$"):
        check_choice("tail", "x", ("pad", "drop"), "why")
    with pytest.raises(ValueError, match=r"^job must be a non-empty string of at most 3 characters \(got job=''\)$"):
        check_name("job", "", 3)
    with pytest.raises(TypeError, match=r"^flag must be a bool \(got flag=1\)$"):
        check_bool("flag", 1)
    assert check_type("url", "memory://", str) == "memory://"
    with pytest.raises(TypeError, match=r"^url must be of type str \(got int\)$"):
        check_type("url", 3, str)
    with pytest.raises(ValueError, match=r"^n must be of type int \(got bool\)$"):
        check_type("n", True, int, ValueError)
    long = "x" * 500
    assert show(long) == repr(long)[:77] + "..." and len(show(long)) == 80
    with pytest.raises(ValueError) as info:
        check_choice("tail", long, ("pad",))
    assert len(str(info.value)) < 200


# --------------------------------------------------------------------------- the guard


def hand_written_int_checks(tree: ast.AST) -> list[int]:
    """Lines that test for a bool with isinstance: the mark of an int check written by hand
    (``isinstance(v, bool) or not isinstance(v, int)``), which core/checks.py's is_int and
    check_int are for."""
    lines = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and len(node.args) == 2):
            continue
        kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        if any(isinstance(k, ast.Name) and k.id == "bool" for k in kinds):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_guard_finds_a_hand_written_int_check() -> None:
    planted = ast.parse("def f(v):\n    if isinstance(v, bool) or not isinstance(v, int):\n        raise TypeError(v)\n"
                        "    return isinstance(v, (str, bool))\n")
    assert hand_written_int_checks(planted) == [2, 4]
    assert hand_written_int_checks(ast.parse("isinstance(v, bytes) and is_int(v)")) == []


def test_value_checks_are_written_only_in_core_checks() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "core/checks.py":
                continue
            found += [f"{rel}:{line}" for line in hand_written_int_checks(ast.parse(path.read_text(), rel))]
    assert not found, f"int checks written by hand (use croupier.core.checks): {found}"
