"""A sampler's changes of its running mixture: new weights, a grown source, samples taken out (``croupier.core.amend``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from croupier.core.amend import Amendment
from croupier.core.errors import CroupierError
from croupier.core.mixture import parts_of

if TYPE_CHECKING:
    from croupier.client._base import _Base


def set_weights(s: _Base, weights: Sequence[float]) -> Amendment:
    """Records new weights for the job's mixture, one per source (any positive scale).

    They hold from the first sample the job's next generation deals (a restart, a resize or a
    rollback starts one), on every rank at once, until the end of the run: the spec's schedule of
    weights ends there. Each source's epochs go on across the change. Call it on one rank.

    Returns:
        The amendment as the coordinator recorded it (``at`` None: pending).

    Raises:
        ValueError: bad weights, or a job that deals no mixture (the message says which).
        RuntimeError: the sampler has not joined its coordinator yet (iterate it first, or use
            ``croupier amend``).
    """
    return _amend(s, "weights", parts_of(weights))


def grow(s: _Base, source: int, size: int) -> Amendment:
    """Records that `source` now has `size` samples (shards appended to it).

    The new samples are dealt from that source's next source epoch after the job's next generation
    starts: the source epoch in progress finishes with the samples it began with, so none of its
    samples is dealt twice or left out. Indices are then numbered as a ``ConcatDataset`` of the
    grown sources numbers them; a sampler may be made on the grown dataset (its sources' new sizes).

    Raises:
        ValueError: a source that is not one of the job's, a size that is not larger, a spec with
            lengths (token budgets), or a job that deals no mixture.
        RuntimeError: the sampler has not joined its coordinator yet.
    """
    return _amend(s, "grow", (int(source), int(size)))


def skip(s: _Base, indices: Iterable[int]) -> Amendment:
    """Takes samples out of the job for good (found corrupt): no rank of the job's next generation,
    or of any later one, deals them; ``croupier audit`` counts them as skipped, not missing.

    `indices` are dataset indices as this sampler hands them out. They hold from the first sample
    the next generation deals, in the source epoch in progress too; with ``tail="pad_last"`` a job
    resumed inside an epoch holds them from the next epoch (a pad copies the epoch's last position,
    which may have been dealt already), so a corrupt sample found mid-epoch there must also be
    passed over by the dataset until that epoch ends.

    Raises:
        ValueError: an index out of range or skipped already, a skip that would leave a source
            empty, or a job that deals no mixture.
        RuntimeError: the sampler has not joined its coordinator yet.
    """
    return _amend(s, "skip", tuple(int(i) for i in indices))


def _amend(s: _Base, kind: str, values: Sequence[int]) -> Amendment:
    if s.spec.sources is None:
        raise ValueError(f"job {s.job!r} deals one dataset: new weights, grown sources and skipped samples are changes "
                         "of a mixture (make the sampler with weights=)")
    if s._client is None or s._client.closed:
        raise RuntimeError(
            f"this sampler of job {s.job!r} has not joined its coordinator yet: call {kind} after its first batch, "
            f"or record it with `croupier amend {s.job} ...`")
    try:
        return s._client.amend(s.job, kind, values)
    except CroupierError as e:
        raise ValueError(str(e)) from None
