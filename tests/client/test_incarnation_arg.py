"""A sampler's incarnation= argument, and token=, its old name: still taken with a DeprecationWarning, never both."""

from __future__ import annotations

import warnings

import pytest

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.server import Server


@pytest.mark.parametrize("kind", ["index", "batch"])
def test_token_still_names_the_incarnation_with_a_deprecation_warning(server: Server, kind: str) -> None:
    with pytest.warns(DeprecationWarning, match=r"token= is deprecated: give incarnation="):
        s = (DistributedSampler(20, 1, 0, address=server.address, job=f"old-{kind}", token="run-1") if kind == "index"
             else DistributedBatchSampler(20, 4, 1, 0, address=server.address, job=f"old-{kind}", token="run-1"))
    assert len(list(s)) == (20 if kind == "index" else 5)
    assert s.incarnation == "run-1"
    s.close()


def test_incarnation_is_taken_without_a_warning(server: Server) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        s = DistributedSampler(20, 1, 0, address=server.address, job="new", incarnation="run-2")
    assert sorted(s) == list(range(20)) and s.incarnation == "run-2"
    s.close()


@pytest.mark.parametrize("cls", [DistributedSampler, DistributedBatchSampler])
def test_incarnation_and_token_at_once_are_refused(cls: type) -> None:
    with pytest.raises(TypeError, match=r"incarnation='a' and token='b': token= is the old name of incarnation="):
        cls(20, 4, address="127.0.0.1:1", job="both", incarnation="a", token="b") if cls is DistributedBatchSampler \
            else cls(20, address="127.0.0.1:1", job="both", incarnation="a", token="b")
