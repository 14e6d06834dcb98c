"""How many examples a property test draws: all of them in `make test`, a fifth in `make check` (CROUPIER_QUICK=1)."""

from __future__ import annotations

import os


def examples(n: int) -> int:
    """`n`, or a fifth of it (at least 10) when CROUPIER_QUICK is set: the edit loop's lane keeps every
    property but draws fewer cases; `make test` and CI draw them all."""
    return max(10, n // 5) if os.environ.get("CROUPIER_QUICK") else n
