"""A sampler's changes of its running mixture (`Amender`): new weights, a grown source, samples taken out."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from croupier.client._rpc import CoordinatorClient
from croupier.core.amend import Amendment
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
