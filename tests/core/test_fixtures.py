"""Checkpoint states written by past and present releases (tests/fixtures/): keep these fixtures forever;
a later release must still load them or refuse them with an error naming both versions."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.core import ORDER_VERSION
from croupier.core.checkpoint import VERSION
from croupier.core.errors import FailedPrecondition

FIXTURES = sorted((pathlib.Path(__file__).resolve().parents[1] / "fixtures").glob("checkpoint-v*.json"))
SAMPLERS: dict[str, type[DistributedSampler] | type[DistributedBatchSampler]] = {
    "DistributedSampler": DistributedSampler,
    "DistributedBatchSampler": DistributedBatchSampler,
}


def test_the_fixtures_are_all_there() -> None:
    """Both releases' states of every order kind that changed or may change: none may go missing."""
    names = {p.name for p in FIXTURES}
    for v in (1, 2, 3):
        assert {f"checkpoint-v{v}-{kind}.json" for kind in ("feistel", "bucket", "torch")} <= names


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_a_fixture_loads_and_yields_the_rest_of_its_epoch_or_is_refused(path: pathlib.Path) -> None:
    fx: dict[str, Any] = json.loads(path.read_text())
    state = fx["state"]
    assert (state["version"], state.get("order", 1)) == (fx["format"], fx["order"]), "the fixture's own record"
    sampler = SAMPLERS[fx["sampler"]](num_replicas=fx["world"], rank=0, job=fx["job"], **fx["args"])
    try:
        ours = (fx["format"], fx["order"]) == (VERSION, ORDER_VERSION)
        try:
            sampler.load_state_dict(state)
        except FailedPrecondition as e:
            assert not ours, f"this release refused its own state: {e}"
            msg = str(e)
            # Both versions by name: the state's format and order version, and this release's.
            theirs = (f"format version {fx['format']} (", f"order version {fx['order']} (format {fx['format']})")
            assert any(t in msg for t in theirs) and f"order version {fx['order']}" in msg, msg
            assert f"reads format {VERSION} with order version {ORDER_VERSION}" in msg, msg
            return
        # Loaded: only a release that still reads the state's format and orders may do that.
        assert sampler.epoch == state["epoch"]
        assert list(sampler) == fx["rest"]
    finally:
        sampler.close()


def test_this_release_refuses_croupier_0_1_states_and_loads_its_own() -> None:
    """What the test above allows either way, pinned for this release: format 1 refused, formats 2 and 3 read."""
    by_name = {p.name: json.loads(p.read_text()) for p in FIXTURES}
    old = by_name["checkpoint-v1-bucket.json"]
    s = DistributedBatchSampler(num_replicas=1, rank=0, job=old["job"], **old["args"])
    with pytest.raises(FailedPrecondition) as e:
        s.load_state_dict(old["state"])
    assert str(e.value).startswith(
        "checkpoint state format version 1 (croupier 0.1, order version 1) is from an earlier release; "
        "this release reads format 3 with order version 2; restart epoch 2"
    )
    s.close()
    # Why: the same settings and the same positions left, under this release's bucket order, are other batches.
    new = by_name["checkpoint-v2-bucket.json"]
    assert new["args"] == old["args"] and new["state"]["remaining"] == old["state"]["remaining"]
    assert new["rest"] != old["rest"]
    s = DistributedBatchSampler(num_replicas=1, rank=0, job=new["job"], **new["args"])
    s.load_state_dict(new["state"])
    assert list(s) == new["rest"]
    s.close()


def test_a_resume_counts_its_items_from_the_state_not_from_its_origin() -> None:
    """Format 3 carries the checkpointing rank's items as a field: ``len()`` and ``items_done`` read it."""
    fx = json.loads((FIXTURES[0].parent / "checkpoint-v3-feistel.json").read_text())
    world = fx["written_at_world"]
    for items, expect in ((5, 5), (None, fx["state"]["items"])):  # None: no field, the positions taken count
        state = {k: v for k, v in fx["state"].items() if k != "origin" and k != "items"}
        if items is not None:
            state["items"] = items
        s = DistributedSampler(num_replicas=world, rank=0, job=fx["job"], **fx["args"])
        try:
            s.load_state_dict(state)
            assert s.items_done == expect
        finally:
            s.close()
    s = DistributedSampler(num_replicas=world, rank=0, job=fx["job"], **fx["args"])
    with pytest.raises(ValueError, match=r"items must be >= 0 \(got checkpoint state's items=-1\)"):
        s.load_state_dict({**fx["state"], "items": -1})
    s.close()
