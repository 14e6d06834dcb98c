"""`croupier amend` and `croupier skip`: record a change of a running mixture at its coordinator."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from croupier.core import settings
from croupier.core.errors import CroupierError
from croupier.core.mixture import parts_of

DEFAULT_ADDRESS = "127.0.0.1:50051"


def values_of(kind: str, raw: Sequence[str]) -> tuple[int, ...]:
    """The request's values from the command line's words: weights as parts, a grow's (source, size), indices.

    Raises:
        ValueError: words that are not numbers of that kind (the message names them).
    """
    try:
        if kind == "weights":
            return parts_of([float(w) for part in raw for w in part.split(",") if w])
        return tuple(int(v) for part in raw for v in part.split(",") if v)
    except ValueError as e:
        raise ValueError(f"{kind} takes numbers (got {' '.join(raw)!r}): {e}") from None


def main(address: str | None, job: str, kind: str, raw: Sequence[str], out: TextIO | None = None) -> int:
    """Records the change and prints it; 0 once recorded, 1 when the coordinator refuses it (the reason printed).

    A skip's answer names every (source, sample) it recorded, one a line: the indices are read as
    the job's ranks hand them out (numbered by the grows their generation holds, not by a pending one).

    Args:
        address: HOST:PORT of the coordinator; None for ``CROUPIER_ADDRESS``, else 127.0.0.1:50051.
        job: The job's name.
        kind: ``"weights"``, ``"grow"`` or ``"skip"``.
        raw: The values as typed: weights (``0.2,0.3,0.5``), a grow's ``SOURCE SIZE``, indices.
    """
    from croupier.client import CoordinatorClient

    out = sys.stdout if out is None else out
    values = values_of(kind, raw)
    with CoordinatorClient(address or settings.get("CROUPIER_ADDRESS") or DEFAULT_ADDRESS, retry_for=10.0) as client:
        try:
            a = client.amend(job, kind, values)
        except CroupierError as e:
            print(f"croupier {'skip' if kind == 'skip' else 'amend'}: {e}", file=sys.stderr)
            return 1
    out.write(f"job {job!r}: recorded {a.describe()}; it holds from the first sample the job's next generation "
              "deals (a restart, a resize or a rollback starts one)\n")
    if kind == "skip":  # every pair, not only the few describe() shows
        out.write("".join(f"  skipped: source {s}, sample {j}\n" for s, j in a.pairs))
    return 0
