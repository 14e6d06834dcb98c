"""The servicer's conversions that are not plain field copies: a lease's batch sizes on the answer, and the client's reading of them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from croupier.client._rpc import CoordinatorClient
from croupier.core.api import JoinRequest
from croupier.core.spec import Spec
from croupier.server._coordinator import Coordinator
from croupier.server._memory_store import MemoryStore
from croupier.server._rpcs import CoordinatorServicer, _with_sizes, fixed_sizes
from croupier.v1 import coordinator_pb2 as pb


@pytest.mark.parametrize("sizes", [
    [], [1], [7], [1] * 65_536, [256] * 255 + [17], [4, 4, 4, 4], [4, 4, 4, 3], [3, 4, 4, 4], [5, 4, 4, 4], [2, 9, 2, 9],
    [4, 3, 3], [300] * 3 + [301], [4, 3, 4, 4],  # the odd one out not last: set one by one
])
def test_a_leases_sizes_are_the_same_however_they_are_set(sizes: list[int]) -> None:
    """Sizes merged from a cached encoding (fixed batches) or set one by one (any others) give the same answer."""
    want = pb.LeaseResponse(indices=b"\x01\x02", itemsize=4, end_of_epoch=True, epoch_samples=9, sizes=sizes)
    got = _with_sizes(pb.LeaseResponse(indices=b"\x01\x02", itemsize=4, end_of_epoch=True, epoch_samples=9), sizes)
    assert list(got.sizes) == sizes
    assert got == want


@pytest.mark.parametrize("sizes", [
    [], [1], [7], [1] * 65_536, [256] * 255 + [17], [4, 4, 4, 4], [4, 4, 4, 3], [3, 4, 4, 4], [5, 4, 4, 4], [2, 9, 2, 9],
    [4, 3, 3], [300] * 3 + [301], [4, 3, 4, 4],
])
def test_fixed_sizes_names_exactly_the_sizes_of_fixed_batches(sizes: list[int]) -> None:
    """(count, size, last) is given only when those three rebuild every size; never for sizes that vary."""
    fixed = fixed_sizes(sizes)
    rebuilt = [] if fixed is None else [fixed[1]] * (fixed[0] - 1) + [fixed[2]]
    assert (fixed is not None) == (bool(sizes) and rebuilt == sizes)


@pytest.fixture
def servicer() -> Iterator[CoordinatorServicer]:
    core = Coordinator(MemoryStore())
    try:
        yield CoordinatorServicer(core)
    finally:
        core.close()


def _started(sv: CoordinatorServicer, job: str, spec: Spec, world: int) -> int:
    gens = {sv.core.join(JoinRequest(job, spec, "a", world, r)).generation for r in range(world)}
    assert len(gens) == 1
    return gens.pop()


def test_a_lease_of_fixed_batches_is_three_numbers_for_a_caller_that_reads_them(servicer: CoordinatorServicer) -> None:
    """With ``fixed_sizes`` the answer names its batches by count, size and last size and leaves `sizes` empty;
    without it (a client older than the field) it holds every size, as before; the indices are the same."""
    spec = Spec(n=1_003, seed=7, batch_size=4)
    gen = _started(servicer, "j", spec, 3)
    for first, count in ((0, 10), (80, 10)):  # the second reaches rank 0's short last batch
        req = pb.LeaseRequest(job="j", generation=gen, rank=0, epoch=0, first_batch=first, count=count)
        old = servicer.Lease(req, None)
        req.fixed_sizes = True
        new = servicer.Lease(req, None)
        assert old.indices == new.indices and len(old.sizes) > 0 and not new.sizes
        assert (new.batches, new.batch_size, new.last_size) == (len(old.sizes), old.sizes[0], old.sizes[-1])
        assert list(old.sizes) == [new.batch_size] * (new.batches - 1) + [new.last_size]
        assert new.end_of_epoch == old.end_of_epoch == (first == 80)


def test_a_lease_of_batches_that_vary_keeps_every_size(servicer: CoordinatorServicer) -> None:
    """Token-budget batches vary in size: their answer holds each size whatever the request says, and no count."""
    lengths = np.random.default_rng(3).integers(1, 33, size=300)
    spec = Spec.with_lengths(lengths, seed=5, max_tokens=32, permutation="feistel")
    gen = _started(servicer, "t", spec, 2)
    got = servicer.Lease(pb.LeaseRequest(job="t", generation=gen, rank=1, epoch=0, first_batch=0, count=40,
                                         fixed_sizes=True), None)
    assert len(set(got.sizes)) > 1 and got.batches == 0
    assert sum(got.sizes) * got.itemsize == len(got.indices)


class _Stub:
    """What a coordinator answers a Lease with, canned (a coordinator of another release)."""

    def __init__(self, answer: pb.LeaseResponse) -> None:
        self.answer = answer
        self.asked: list[pb.LeaseRequest] = []

    def Lease(self, m: pb.LeaseRequest, timeout: float) -> pb.LeaseResponse:
        self.asked.append(m)
        return self.answer


def _client_with(answer: pb.LeaseResponse) -> tuple[CoordinatorClient, _Stub]:
    c = CoordinatorClient("127.0.0.1:1", retry_for=0.0)
    stub = _Stub(answer)
    c.stub = stub  # type: ignore[assignment]
    return c, stub


def test_the_client_reads_both_forms_of_a_lease() -> None:
    """The client asks for fixed sizes and reads them; from a coordinator that sends every size (older than the
    field) it reads those; the same lease either way."""
    data = np.arange(10, dtype="<u4").tobytes()
    fixed = pb.LeaseResponse(indices=data, itemsize=4, batches=3, batch_size=4, last_size=2, epoch_samples=10)
    every = pb.LeaseResponse(indices=data, itemsize=4, sizes=[4, 4, 2], epoch_samples=10)
    got = []
    for answer in (fixed, every):
        c, stub = _client_with(answer)
        try:
            got.append(c.lease("j", 1, 0, 0, 0, 3))
        finally:
            c.close()
        assert stub.asked[0].fixed_sizes
    for lease in got:
        assert lease.sizes == [4, 4, 2] and lease.indices.tolist() == list(range(10))
        assert [b.tolist() for b in lease.batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_the_client_refuses_fixed_batches_that_do_not_hold_the_indices() -> None:
    answer = pb.LeaseResponse(indices=np.arange(10, dtype="<u4").tobytes(), itemsize=4, batches=3, batch_size=4,
                              last_size=3)
    c, _ = _client_with(answer)
    try:
        with pytest.raises(ValueError, match=r"lease holds 10 indices but its 3 batches of 4 \(the last 3\) hold 11"):
            c.lease("j", 1, 0, 0, 0, 3)
    finally:
        c.close()
