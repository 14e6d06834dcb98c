"""A sampler's changes of its running mixture (`Amender`): new weights, a grown source, samples taken out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from croupier.client._rpc import CoordinatorClient
from croupier.core.amend import Amendment
from croupier.core.checks import check_count
from croupier.core.errors import CroupierError
from croupier.core.mixture import parts_of
from croupier.core.spec import Spec


class Amended(Protocol):
    """What the amender asks of its sampler: the job, its spec, and its connection once joined."""

    job: str
    spec: Spec

    def _connected(self) -> CoordinatorClient | None:
        """The open connection to the job's coordinator; None before the join (or once closed)."""


class Amender:
    """Records a sampler's changes of its job's mixture at the coordinator (``croupier.core.amend``).

    Args:
        sampler: The sampler whose job is changed (it asks only what :class:`Amended` names).
    """

    def __init__(self, sampler: Amended) -> None:
        self._s = sampler

    def set_weights(self, weights: Sequence[float]) -> Amendment:
        """New weights, one per source (see the sampler's ``set_weights``)."""
        weights = list(weights)
        if self._s.spec.sources is not None:  # counted before they become parts: the count is the user's
            check_count("weights", weights, len(self._s.spec.sources), "sources")
        return self._amend("weights", parts_of(weights))

    def grow(self, source: int, size: int) -> Amendment:
        """`source` now has `size` samples (see the sampler's ``grow``)."""
        return self._amend("grow", (int(source), int(size)))

    def skip(self, indices: Iterable[int]) -> Amendment:
        """Samples taken out of the job for good (see the sampler's ``skip``)."""
        return self._amend("skip", tuple(int(i) for i in indices))

    def _amend(self, kind: str, values: Sequence[int]) -> Amendment:
        s = self._s
        if s.spec.sources is None:
            raise ValueError(f"job {s.job!r} deals one dataset: new weights, grown sources and skipped samples are "
                             "changes of a mixture (make the sampler with weights=)")
        client = s._connected()
        if client is None:
            raise RuntimeError(
                f"this sampler of job {s.job!r} has not joined its coordinator yet: call {kind} after its first batch, "
                f"or record it with `croupier amend {s.job} ...`")
        try:
            return client.amend(s.job, kind, values)
        except CroupierError as e:
            raise ValueError(str(e)) from None


class Amending:
    """The samplers' methods that change their job's mixture, each handed to their :class:`Amender`."""

    _amender: Amender

    def set_weights(self, weights: Sequence[float]) -> Amendment:
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
        return self._amender.set_weights(weights)

    def grow(self, source: int, size: int) -> Amendment:
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
        return self._amender.grow(source, size)

    def skip(self, indices: Iterable[int]) -> Amendment:
        """Takes samples out of the job for good (found corrupt): no rank of the job's next generation,
        or of any later one, deals them; ``croupier audit`` counts them as skipped, not missing.

        `indices` are dataset indices as this sampler hands them out (a grow recorded since its
        generation started renumbers nothing until the next one). They hold from the first sample
        the next generation deals, in the source epoch in progress too; with ``tail="pad_last"`` a job
        resumed inside an epoch holds them from the next epoch (a pad copies the epoch's last position,
        which may have been dealt already), so a corrupt sample found mid-epoch there must also be
        passed over by the dataset until that epoch ends.

        Returns:
            The amendment as the coordinator recorded it: its ``pairs`` are the (source, sample)
            pairs taken out, each sample as numbered within its source.

        Raises:
            ValueError: an index out of range or skipped already, a skip that would leave a source
                empty, or a job that deals no mixture.
            RuntimeError: the sampler has not joined its coordinator yet.
        """
        return self._amender.skip(indices)
