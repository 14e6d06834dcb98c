"""The journal's schema table and the codec it drives (server/_events.py).

Every event type round-trips through msgpack; each one's record is pinned field by field (a field
dropped from the table, renamed, reordered or written another way fails here, and the schema check
at import refuses a table that leaves out a field of its event); an unknown tag and a malformed
record are refused with an error naming them.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from croupier.core.amend import Amendment
from croupier.core.cursor import Cursor
from croupier.core.mixture import PARTS
from croupier.core.spec import ORDER_VERSION, Spec
from croupier.server._events import (
    FORMAT_VERSION,
    INT,
    OPT_CURSOR,
    SCHEMA,
    STR,
    AmendmentRecorded,
    AmendmentsLoaded,
    BatchesCommitted,
    BatchesDealt,
    CheckpointRecorded,
    Codec,
    EpochCut,
    Event,
    EventSchema,
    FormatError,
    GenerationAmended,
    GenerationOpened,
    GenerationStarted,
    JobRegistered,
    ProgressReported,
    RankJoined,
    StepCommitted,
    check_schema,
    decode_event,
    encode_event,
)

SPEC = Spec.with_lengths([4, 1, 3, 2], seed=5, buffer_size=2, pack_size=2, batch_size=2)
CURSOR = Cursor(2, ((0, 1), (3, 4)), 2)
C = [2, [[0, 1], [3, 4]], 2]  # CURSOR as a record writes it
HEAD = {"version": FORMAT_VERSION, "order": ORDER_VERSION}

#: One event of each type and its record, as written by this format version: the golden vectors.
GOLDEN: list[tuple[Event, dict[str, Any]]] = [
    (JobRegistered("j", SPEC), {"type": "JobRegistered", **HEAD, "job": "j", "spec": SPEC.to_dict()}),
    (GenerationOpened("j", 1, 2, "tok"),
     {"type": "GenerationOpened", **HEAD, "job": "j", "generation": 1, "world": 2, "token": "tok"}),
    (RankJoined("j", 1, 0, CURSOR, 2, 40, 1, (64, 16, 16, 100)),
     {"type": "RankJoined", **HEAD, "job": "j", "generation": 1, "rank": 0, "resume": C, "epoch": 2, "step": 40,
      "parent": 1, "schedule": [64, 16, 16, 100]}),
    (RankJoined("j", 1, 1, None, None),
     {"type": "RankJoined", **HEAD, "job": "j", "generation": 1, "rank": 1, "resume": None, "epoch": None,
      "step": None, "parent": None, "schedule": None}),
    (GenerationStarted("j", 1, CURSOR, 40, 1, (64, 0, 0, 0), 1650),
     {"type": "GenerationStarted", **HEAD, "job": "j", "generation": 1, "start": C, "step": 40, "parent": 1,
      "schedule": [64, 0, 0, 0], "at_ms": 1650}),
    (ProgressReported("j", 1, 0, 2, 3, 1700),
     {"type": "ProgressReported", **HEAD, "job": "j", "generation": 1, "rank": 0, "epoch": 2, "batches": 3,
      "at_ms": 1700}),
    (CheckpointRecorded("j", 1, 1, 40, CURSOR, "rank 1", 1800, 12),
     {"type": "CheckpointRecorded", **HEAD, "job": "j", "generation": 1, "rank": 1, "step": 40, "cursor": C,
      "origin": "rank 1", "at_ms": 1800, "items": 12}),
    (CheckpointRecorded("j", 1, 1, None, CURSOR, "", 1800),
     {"type": "CheckpointRecorded", **HEAD, "job": "j", "generation": 1, "rank": 1, "step": None, "cursor": C,
      "origin": "", "at_ms": 1800, "items": None}),
    (BatchesDealt("j", 1, 0, 2, 6, 3),
     {"type": "BatchesDealt", **HEAD, "job": "j", "generation": 1, "rank": 0, "epoch": 2, "first": 6, "count": 3}),
    (BatchesCommitted("j", 1, 0, 2, 5),
     {"type": "BatchesCommitted", **HEAD, "job": "j", "generation": 1, "rank": 0, "epoch": 2, "batches": 5}),
    (AmendmentRecorded("j", "skip", (0, 3, 1, 7)),
     {"type": "AmendmentRecorded", **HEAD, "job": "j", "kind": "skip", "values": [0, 3, 1, 7]}),
    (AmendmentsLoaded("j", 2, (Amendment("grow", (1, 10, 12), 96),)),
     {"type": "AmendmentsLoaded", **HEAD, "job": "j", "generation": 2, "amendments": [["grow", [1, 10, 12], 96]]}),
    (GenerationAmended("j", 2, (Amendment("grow", (1, 10, 12), 96), Amendment("weights", (PARTS,), 120))),
     {"type": "GenerationAmended", **HEAD, "job": "j", "generation": 2,
      "amendments": [["grow", [1, 10, 12], 96], ["weights", [PARTS], 120]]}),
    (StepCommitted("j", "run-b", "run-a", 7, "global", 12, 9, 108, 120, 4, 3),
     {"type": "StepCommitted", **HEAD, "job": "j", "run": "run-b", "parent": "run-a", "resumed": 7, "mode": "global",
      "batch": 12, "step": 9, "start": 108, "stop": 120, "quorum": 4, "participants": 3}),
    (EpochCut("j", 2, 1, 7), {"type": "EpochCut", **HEAD, "job": "j", "generation": 2, "epoch": 1, "micro": 7}),
]


def _packed(d: object) -> bytes:
    return bytes(msgpack.packb(d))


def test_the_golden_records_cover_every_event_type() -> None:
    assert {type(ev) for ev, _ in GOLDEN} == set(typing.get_args(Event)) == {row.type for row in SCHEMA}


@pytest.mark.parametrize(("ev", "record"), GOLDEN, ids=lambda x: type(x).__name__)
def test_every_event_writes_its_golden_record_and_reads_it_back(ev: Event, record: dict[str, Any]) -> None:
    written = msgpack.unpackb(_packed(encode_event(ev)))
    # items, not ==: the order of a record's fields is part of its bytes
    assert list(written.items()) == list(record.items())
    assert _packed(encode_event(ev)) == _packed(record)
    assert decode_event(written) == ev


# -- every event, any values ----------------------------------------------------------------------------

_NAMES = st.text(min_size=0, max_size=12)
_INTS = st.integers(min_value=0, max_value=2**62)
_CURSORS = st.builds(
    Cursor,
    st.integers(0, 1000),
    st.lists(st.tuples(_INTS, _INTS), max_size=4).map(tuple),
    st.integers(0, 64),
)
_SPECS = st.sampled_from([SPEC, Spec(n=100, seed=1, batch_size=4), Spec(n=64, seed=3, batch_size=2, dealing="dynamic", tail="uneven")])
#: A value of every field type the schema writes, by the field's annotation.
_VALUES = {
    "str": _NAMES,
    "int": _INTS,
    "int | None": st.none() | _INTS,
    "Spec": _SPECS,
    "Cursor": _CURSORS,
    "Cursor | None": st.none() | _CURSORS,
    "tuple[int, ...]": st.lists(_INTS, max_size=6).map(tuple),
    "tuple[int, ...] | None": st.none() | st.lists(_INTS, max_size=6).map(tuple),
    "tuple[Amendment, ...]": st.lists(st.builds(Amendment, st.sampled_from(["weights", "grow", "skip"]),
                                                st.lists(_INTS, max_size=4).map(tuple), st.none() | _INTS),
                                      max_size=3).map(tuple),
}


def _event(row: EventSchema) -> st.SearchStrategy[Any]:
    return st.builds(row.type, **{name: _VALUES[codec.annotation] for name, codec in row.fields})


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SCHEMA).flatmap(_event))
def test_every_event_round_trips_through_msgpack(ev: Event) -> None:
    d = msgpack.unpackb(_packed(encode_event(ev)))
    assert decode_event(d) == ev
    row = next(r for r in SCHEMA if r.type is type(ev))
    assert list(d) == ["type", "version", "order", *(row.key(f.name) for f in dataclasses.fields(ev))]


def test_the_incarnation_is_stored_under_the_key_token() -> None:
    """GenerationOpened.incarnation is written and read as "token", the key the journal has always had."""
    d = msgpack.unpackb(_packed(encode_event(GenerationOpened("j", 3, 2, "run-7"))))
    assert d["token"] == "run-7" and "incarnation" not in d
    old = {"type": "GenerationOpened", **HEAD, "job": "j", "generation": 3, "world": 2, "token": "run-7"}
    assert decode_event(old) == GenerationOpened("j", 3, 2, "run-7")
    renamed = {**_without(old, "token"), "incarnation": "run-7"}
    with pytest.raises(FormatError, match=r"missing \['token'\]"):
        decode_event(renamed)


# -- refusals -------------------------------------------------------------------------------------------


def _record(i: int, **changes: Any) -> dict[str, Any]:
    return {**GOLDEN[i][1], **changes}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize(
    ("d", "why"),
    [
        ([1, 2], r"an event must be a map \(got list\)"),
        (_record(1, type="GenerationClosed"), r"unknown event type 'GenerationClosed' \(known: \['AmendmentRecorded'"),
        (_record(1, type=7), r"unknown event type 7"),
        (_without(GOLDEN[1][1], "version"), r"the event has no format version"),
        (_without(GOLDEN[1][1], "token"), r"a GenerationOpened event must have the fields .* \(missing \['token'\]"),
        (_record(1, colour="red"), r"a GenerationOpened event must have the fields .* unknown \['colour'\]"),
        (_record(5, at_ms="now"), r"ProgressReported.at_ms must be an int \(got ProgressReported.at_ms='now'\)"),
        (_record(6, step=True), r"CheckpointRecorded.step must be an int"),
        (_record(6, cursor=None), r"CheckpointRecorded.cursor \(a cursor .*\) must be a list of 3"),
        (_record(6, origin=b"rank"), r"CheckpointRecorded.origin must be a str"),
        (_record(8, count=[3]), r"BatchesDealt.count must be an int"),
        (_record(9, rank=None), r"BatchesCommitted.rank must be an int"),
        (_record(1, order=ORDER_VERSION + 1), r"event was written with order version"),
    ],
)
def test_a_malformed_record_is_refused_by_name(d: Any, why: str) -> None:
    with pytest.raises(FormatError, match=why):
        decode_event(msgpack.unpackb(_packed(d)))


def test_encoding_a_non_event_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"not an event: \('j', 1\)"):
        encode_event(("j", 1))  # type: ignore[arg-type]


# -- the table is checked against the events -------------------------------------------------------------


def _replaced(which: str, **change: Any) -> tuple[EventSchema, ...]:
    """SCHEMA with the row tagged `which` changed as given."""
    return tuple(dataclasses.replace(row, **change) if row.tag == which else row for row in SCHEMA)


def test_the_schema_of_this_release_passes_its_check() -> None:
    check_schema(SCHEMA)


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (_replaced("GenerationOpened", fields=(("job", STR), ("generation", INT), ("world", INT))),
         r"GenerationOpened has the fields .* \(not in the table: \['incarnation'\]"),
        (_replaced("GenerationOpened", fields=(("job", STR), ("generation", INT), ("incarnation", STR), ("world", INT))),
         r"GenerationOpened .* \(another order\)"),
        (_replaced("BatchesDealt", fields=(*next(r for r in SCHEMA if r.tag == "BatchesDealt").fields, ("why", STR))),
         r"BatchesDealt .* \(not in the event: \['why'\]\)"),
        (_replaced("RankJoined", fields=(("job", STR), ("generation", INT), ("rank", INT), ("resume", OPT_CURSOR),
                                         ("epoch", INT), *next(r for r in SCHEMA if r.tag == "RankJoined").fields[5:])),
         r"writes RankJoined.epoch as int, but the field is int \| None"),
        (_replaced("RankJoined", tag="JobRegistered"), r"the tags \['JobRegistered'\] twice"),
        (tuple(row for row in SCHEMA if row.type is not BatchesCommitted), r"no row: \['BatchesCommitted'\]"),
        ((*SCHEMA, EventSchema("Noted", Codec, ())), r"not an event: \['Codec'\]"),
    ],
)
def test_a_schema_that_drifts_from_its_events_is_refused(schema: tuple[EventSchema, ...], why: str) -> None:
    with pytest.raises(TypeError, match=why):
        check_schema(schema)


@pytest.mark.parametrize(("record", "ev"), [
    ({"type": "RankJoined", "job": "j", "generation": 1, "rank": 0, "resume": C, "epoch": 2},
     RankJoined("j", 1, 0, CURSOR, 2, None, None, None)),
    ({"type": "GenerationStarted", "job": "j", "generation": 1, "start": C}, GenerationStarted("j", 1, CURSOR)),
    ({"type": "CheckpointRecorded", "job": "j", "generation": 1, "rank": 1, "step": 40, "cursor": C, "origin": "o",
      "at_ms": 1800}, CheckpointRecorded("j", 1, 1, 40, CURSOR, "o", 1800, None)),
], ids=lambda x: x["type"] if isinstance(x, dict) else "")
def test_a_version_5_record_reads_without_the_ledger_fields(record: dict[str, Any], ev: Event) -> None:
    assert decode_event({**record, "version": 5, "order": ORDER_VERSION}) == ev
    with pytest.raises(FormatError, match="missing"):  # the current version must have them
        decode_event({**record, "version": FORMAT_VERSION, "order": ORDER_VERSION})


def test_a_version_7_generation_start_reads_without_its_time() -> None:
    """Format 8 added GenerationStarted's time: a record of format 7 reads with none (its segment's time is 0)."""
    record = {"type": "GenerationStarted", "job": "j", "generation": 1, "start": C, "step": 40, "parent": 1,
              "schedule": None}
    assert decode_event({**record, "version": 7, "order": ORDER_VERSION}) == GenerationStarted("j", 1, CURSOR, 40, 1)
    with pytest.raises(FormatError, match="missing"):
        decode_event({**record, "version": FORMAT_VERSION, "order": ORDER_VERSION})
