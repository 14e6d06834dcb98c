"""The servicer's conversions that are not plain field copies: a lease's batch sizes on the answer."""

from __future__ import annotations

import pytest

from croupier.server._rpcs import _with_sizes
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
