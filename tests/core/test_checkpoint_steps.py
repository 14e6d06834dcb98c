"""Checkpoint state format 5: the trainer's step and the generation that took the state, as fields.

A state that names neither stays what the release before wrote (format 3, or 4 for a mixture), byte
for byte; a coordinator's record becomes a state from the record's fields, not from its origin.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from croupier.client import DistributedBatchSampler, DistributedSampler
from croupier.core import checkpoint
from croupier.core.amend import Amendment
from croupier.core.api import CheckpointRecord
from croupier.core.checkpoint import (
    READS,
    VERSION,
    WITH_AMENDMENTS,
    WITH_STEPS,
    Taken,
    amendments_of,
    from_state,
    items_of,
    state_of_record,
    taken_of,
    to_state,
)
from croupier.core.cursor import Cursor
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.mixture import parts_of
from croupier.core.spec import Spec

SPEC = Spec(n=100, seed=3, batch_size=4)
MIX = Spec(n=100, seed=3, sources=(30, 70), weights=((0, parts_of([1, 2])),))
AT = Cursor(1, ((40, 100),))
FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"
SAMPLERS: dict[str, type[DistributedSampler] | type[DistributedBatchSampler]] = {
    "DistributedSampler": DistributedSampler, "DistributedBatchSampler": DistributedBatchSampler}


def test_a_state_without_a_step_is_what_the_release_before_wrote() -> None:
    """Formats 3 and 4 are unchanged, key for key and in order: json.dumps of each is the same bytes."""
    assert (VERSION, WITH_AMENDMENTS, WITH_STEPS, READS) == (3, 4, 5, (2, 3, 4, 5))
    st = to_state("j", SPEC, AT, 9, "inc/1/9")
    assert json.dumps(st) == json.dumps({
        "version": 3, "order": 2, "job": "j", "fingerprint": SPEC.fingerprint, "epoch": 1, "remaining": [[40, 100]],
        "base_world": 0, "items": 9, "origin": "inc/1/9"})
    skip = Amendment("skip", (0, 5), 20)
    mix = to_state("j", MIX, Cursor(1, ((40, 100),)), 9, "inc/1/9", (skip,))
    assert mix["version"] == WITH_AMENDMENTS and not {"step", "generation", "incarnation"} & set(mix)
    # a sampler that loads a fixture of format 3 and saves before its first batch gives it back, byte for byte
    for path in sorted(FIXTURES.glob("checkpoint-v3-*.json")):
        fx = json.loads(path.read_text())
        sampler = SAMPLERS[fx["sampler"]](num_replicas=fx["world"], rank=0, job=fx["job"], **fx["args"])
        try:
            sampler.load_state_dict(fx["state"])
            assert json.dumps(sampler.state_dict()) == json.dumps(fx["state"]), path.name
            assert json.dumps(sampler.state_dict(step=5)) != json.dumps(fx["state"])  # a step named: format 5
        finally:
            sampler.close()


def test_a_state_that_names_a_step_or_a_generation_is_format_5_and_reads_back() -> None:
    for taken in (Taken(7, 2, "inc-2"), Taken(7), Taken(None, 2), Taken(0, 1, "a")):
        st = to_state("j", SPEC, AT, 9, "inc/1/9", (), taken)
        assert st["version"] == WITH_STEPS
        assert from_state("j", SPEC, st) == AT
        assert taken_of(st) == taken
        assert [k for k in ("step", "generation", "incarnation") if k in st] == \
            [k for k in ("step", "generation", "incarnation") if getattr(taken, k) is not None]
        assert items_of(st, AT) == 9
    # a mixture's state with a step carries its amendments too
    skip = Amendment("skip", (0, 5), 20)
    st = to_state("j", MIX, AT, 9, None, (skip,), Taken(3, 1))
    assert st["version"] == WITH_STEPS and amendments_of(st) == (skip,)
    assert from_state("j", MIX, st) == AT


def test_a_release_that_reads_up_to_format_4_refuses_format_5_as_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    st = to_state("j", SPEC, AT, 9, None, (), Taken(7, 2))
    monkeypatch.setattr(checkpoint, "READS", (2, 3, 4))
    with pytest.raises(FailedPrecondition) as e:
        from_state("j", SPEC, st)
    assert str(e.value).startswith("checkpoint state format version 5 (order version 2) is newer than this release")


@pytest.mark.parametrize("key, value, says", [
    ("step", -1, "checkpoint state's step must be >= 0 (got checkpoint state's step=-1)"),
    ("step", "7", "checkpoint state's step must be an int (got checkpoint state's step='7')"),
    ("generation", 0, "checkpoint state's generation must be >= 1 (got checkpoint state's generation=0)"),
    ("incarnation", "", "checkpoint state's incarnation must be a non-empty string"),
])
def test_a_malformed_step_or_generation_is_refused_by_name(key: str, value: object, says: str) -> None:
    st = to_state("j", SPEC, AT, 9, None, (), Taken(7, 2, "inc"))
    with pytest.raises(InvalidArgument) as e:
        from_state("j", SPEC, {**st, key: value})
    assert says in str(e.value)
    with pytest.raises(ValueError, match="step must be >= 0"):
        to_state("j", SPEC, AT, taken=Taken(-1))


def test_an_earlier_format_with_a_step_is_refused() -> None:
    """Format 3 has no step: a state that says 3 and carries one was not written by any release."""
    st = to_state("j", SPEC, AT, 9)
    with pytest.raises(InvalidArgument, match=r"format 3 has no step \(format 5 has; got step=7\)"):
        from_state("j", SPEC, {**st, "step": 7})


def test_a_record_becomes_a_state_from_its_fields_not_its_origin() -> None:
    """The record's items, step and generation are the state's; its origin is only its name."""
    record = CheckpointRecord(step=12, cursor=AT, origin="other/1/999", generation=4, rank=0, recorded_ms=0, items=9)
    st = state_of_record("j", SPEC, record)
    assert (st["items"], st["step"], st["generation"], st["origin"]) == (9, 12, 4, "other/1/999")
    assert st["version"] == WITH_STEPS and "incarnation" not in st  # a record names its generation alone
    assert from_state("j", SPEC, st) == AT and taken_of(st) == Taken(12, 4)
    # a record journaled before checkpoints carried their items names them only in its origin
    legacy = CheckpointRecord(step=None, cursor=AT, origin="t1/1/9", generation=4, rank=0, recorded_ms=0)
    st = state_of_record("j", SPEC, legacy)
    assert (st["items"], st.get("step"), st["generation"]) == (9, None, 4)
    st = state_of_record("j", SPEC, CheckpointRecord(None, AT, "t1/0/9", 4, 0, 0))  # an origin of another epoch
    assert "items" not in st


def test_only_format_2_reads_its_items_from_the_origin() -> None:
    st = to_state("j", SPEC, AT, None, "inc/1/9")
    assert items_of(st, AT) is None  # format 3 without items: not named, whatever the origin says
    assert items_of({**st, "version": 2}, AT) == 9
