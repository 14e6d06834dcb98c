"""How many examples a property test draws: all of them in `make test`, a fifth in `make check` (CROUPIER_QUICK=1)."""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")


def quick() -> bool:
    """True in the edit loop's lane (make check: CROUPIER_QUICK set)."""
    return bool(os.environ.get("CROUPIER_QUICK"))


def cases(items: list[T], keep: int = 5) -> list[T]:
    """`items`, or every `keep`-th of them (the first included) when CROUPIER_QUICK is set: a case
    matrix's cells spread over the edit loop's lane; `make test` and CI run every one."""
    return items[::keep] if quick() else items


def examples(n: int) -> int:
    """`n`, or a fifth of it (at least 10) when CROUPIER_QUICK is set: the edit loop's lane keeps every
    property but draws fewer cases; `make test` and CI draw them all."""
    return max(10, n // 5) if quick() else n
