"""`croupier amend` and `croupier skip`: record a change of a running mixture at its coordinator."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from croupier.core import settings
from croupier.core.amend import sizes_after
from croupier.core.checks import is_int
from croupier.core.errors import CroupierError, FailedPrecondition
from croupier.core.mixture import parts_of

if TYPE_CHECKING:
    from croupier.client import CoordinatorClient


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


def read_skip_file(path: str) -> tuple[list[int], list[dict[str, Any]]]:
    """What ``croupier skip --from FILE`` reads: a JSON list of dataset indices, or ``croupier provenance
    --json``'s step records (of ``--step``: one, of ``--steps``: a list). Returns (indices, kept versions).

    Raises:
        ValueError: the file cannot be read, or holds neither (the message names the file and what it holds).
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--from {path}: cannot read it as JSON: {e}") from None
    if isinstance(doc, list) and doc and all(is_int(v) for v in doc):
        return [int(v) for v in doc], []
    records = [doc] if isinstance(doc, dict) else doc
    if not isinstance(records, list) or not records or not all(
            isinstance(r, dict) and {"step", "kept", "abandoned"} <= set(r) for r in records):
        got = type(doc).__name__ if not isinstance(doc, list) else f"a list of {len(doc)}"
        raise ValueError(f"--from {path} must hold a list of dataset indices or `croupier provenance --step/--steps "
                         f"--json` output (step records with their kept version); got {got}")
    kept = [r["kept"] for r in records if r["kept"] is not None]
    if not kept:
        raise ValueError(f"--from {path}: no step in it has a kept version (steps "
                         f"{', '.join(str(r['step']) for r in records)}): there is no sample to skip")
    try:
        for v in kept:
            if not is_int(v["generation"]):
                raise ValueError
            for b in v["batches"]:
                if len(b["indices"]) != len(b["sources"]) or not all(is_int(i) for i in [*b["indices"], *b["sources"]]):
                    raise ValueError
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"--from {path}: a kept version is not as `croupier provenance --json` writes it (each has "
                         "a generation and batches of indices with their sources)") from None
    return [], kept


def kept_indices(client: CoordinatorClient, job: str, versions: Sequence[dict[str, Any]]) -> tuple[int, ...]:
    """The dataset indices of `versions` (step records' kept versions), numbered as the job's ranks hand them out now.

    NOTE: each version's indices are numbered as its generation handed them out, by the sources'
    sizes under the grows it held; a grow since then moves the indices of the sources after the grown
    one. Each is read as its (source, sample) and renumbered as a skip is read (``croupier skip``).

    Raises:
        FailedPrecondition: the job deals no mixture (skips are changes of a mixture).
        NotFound: no such job.
    """
    led = client.ledger(job)
    sources = led.spec.sources
    if sources is None:
        raise FailedPrecondition(
            f"job {job!r} deals one dataset, not a mixture of sources: a skip takes samples out of a mixture. A job "
            "that may need skips is made a mixture of one source from its start (weights=[1.0], "
            "sources=[len(dataset)]; docs/provenance.md)")
    st = client.status(job)
    waiting = st.result.start is None  # a generation waiting for its ranks deals by every grow recorded
    now = sizes_after(sources, st.amendments if waiting else [a for a in st.amendments if a.at is not None])
    by_gen = {s.generation: s for s in led.segments}
    out: set[int] = set()
    for v in versions:
        seg = by_gen.get(v["generation"])
        then = sizes_after(sources, seg.amendments) if seg is not None else now
        for b in v["batches"]:
            for i, s in zip(b["indices"], b["sources"], strict=True):
                sample = int(i) - sum(then[:s])
                out.add(sum(now[:s]) + sample)
    return tuple(sorted(out))


def main(address: str | None, job: str, kind: str, raw: Sequence[str], out: TextIO | None = None,
         from_file: str | None = None) -> int:
    """Records the change and prints it; 0 once recorded, 1 when the coordinator refuses it (the reason printed).

    A skip's answer names every (source, sample) it recorded, one a line: the indices are read as
    the job's ranks hand them out (numbered by the grows their generation holds, not by a pending one).

    Args:
        address: HOST:PORT of the coordinator; None for ``CROUPIER_ADDRESS``, else 127.0.0.1:50051.
        job: The job's name.
        kind: ``"weights"``, ``"grow"`` or ``"skip"``.
        raw: The values as typed: weights (``0.2,0.3,0.5``), a grow's ``SOURCE SIZE``, indices.
        from_file: A skip's indices from a file instead (:func:`read_skip_file`): every sample of the
            kept versions of ``croupier provenance --json``'s steps, or a JSON list of indices.

    Raises:
        ValueError: values that are not numbers of their kind, both `raw` and `from_file` or
            neither for a skip, or a file :func:`read_skip_file` cannot read (nothing is recorded).
    """
    from croupier.client import CoordinatorClient

    out = sys.stdout if out is None else out
    versions: list[dict[str, Any]] = []
    if from_file is not None:
        if kind != "skip" or raw:
            raise ValueError("croupier skip takes its indices from the command line or from --from FILE, not both")
        listed, versions = read_skip_file(from_file)
        values = tuple(listed)
    else:
        values = values_of(kind, raw)
    with CoordinatorClient(settings.coordinator_address(address), retry_for=10.0) as client:
        try:
            if versions:
                values = kept_indices(client, job, versions)
            a = client.amend(job, kind, values)
        except CroupierError as e:
            print(f"croupier {'skip' if kind == 'skip' else 'amend'}: {e}", file=sys.stderr)
            return 1
    out.write(f"job {job!r}: recorded {a.describe()}; it holds from the first sample the job's next generation "
              "deals (a restart, a resize or a rollback starts one)\n")
    if kind == "skip":  # every pair, not only the few describe() shows
        out.write("".join(f"  skipped: source {s}, sample {j}\n" for s, j in a.pairs))
    return 0
