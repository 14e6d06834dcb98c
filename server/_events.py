"""The coordinator's events and the journal's codec: one schema table drives encoding and decoding.

NOTE: a table in Python rather than a versioned ``.proto`` for the journal: the records already
on disk are msgpack maps (``{"type": ..., "version": ..., "order": ..., <fields>}``) and MUST
keep decoding (tests/fixtures/journal-v2.db, journal-v3.db); a ``.proto`` would be a second
format beside them, while :data:`SCHEMA` describes the one the journal has. Each row names an
event's tag (its ``"type"`` on disk), its frozen dataclass and its fields in record order, each
with the :class:`Codec` that writes and reads it. :func:`check_schema` runs at import: a field of
an event missing from the table (or in the table and not in the event), a codec for another type
than the field's, a tag twice or an event type without a row fails there, naming it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from croupier.core.amend import Amendment
from croupier.core.checks import check_int
from croupier.core.cursor import Cursor
from croupier.core.spec import ORDER_VERSION, Spec

# --------------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class JobRegistered:
    """The first rank of a job joined: the job exists from now on, with `spec`."""

    job: str
    spec: Spec


@dataclasses.dataclass(frozen=True)
class GenerationOpened:
    """A rank joined with an incarnation no generation of the job had: generation `generation` of `world` ranks begins."""

    job: str
    generation: int
    world: int
    incarnation: str


@dataclasses.dataclass(frozen=True)
class RankJoined:
    """`rank` joined the generation with its checkpoint's `resume` point and its `epoch` (set_epoch); either may be None."""

    job: str
    generation: int
    rank: int
    resume: Cursor | None
    epoch: int | None
    step: int | None = None  # the trainer's step at the checkpoint it loaded, if named
    parent: int | None = None  # the generation that took that checkpoint, if named
    schedule: tuple[int, ...] | None = None  # its trainer's step schedule (Schedule.to_list); None: the default


@dataclasses.dataclass(frozen=True)
class GenerationStarted:
    """Every rank joined: the generation deals from `start` (its resume point, bound to its world), its
    trainer at `step` (None: not known), resumed from a checkpoint of generation `parent` (None: a fresh
    start, or not named), with the step schedule `schedule` (None: the default), at `at_ms` (the
    coordinator's clock, decided once; None in a record of format 7 or older: not known)."""

    job: str
    generation: int
    start: Cursor
    step: int | None = None
    parent: int | None = None
    schedule: tuple[int, ...] | None = None
    at_ms: int | None = None


@dataclasses.dataclass(frozen=True)
class ProgressReported:
    """A rank's loop has taken `batches` batches of `epoch` from its share of the generation's plan."""

    job: str
    generation: int
    rank: int
    epoch: int
    batches: int
    at_ms: int


@dataclasses.dataclass(frozen=True)
class CheckpointRecorded:
    """A rank of the generation took a checkpoint state: `cursor`, named after training step `step`."""

    job: str
    generation: int
    rank: int
    step: int | None
    cursor: Cursor
    origin: str
    at_ms: int
    items: int | None = None  # the items of the cursor's epoch the rank had taken, if named


@dataclasses.dataclass(frozen=True)
class BatchesDealt:
    """Dynamic dealing: global batches first .. first + count - 1 of `epoch` went to `rank`."""

    job: str
    generation: int
    rank: int
    epoch: int
    first: int
    count: int


@dataclasses.dataclass(frozen=True)
class BatchesCommitted:
    """Dynamic dealing: `rank` committed the first `batches` batches of its sequence in `epoch` (``own``)."""

    job: str
    generation: int
    rank: int
    epoch: int
    batches: int


@dataclasses.dataclass(frozen=True)
class AmendmentRecorded:
    """A change of the job's mixture was recorded (``croupier.core.amend``): `kind` with `values`. It holds
    from the first stream position of the next generation that starts (see :class:`GenerationAmended`)."""

    job: str
    kind: str
    values: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class AmendmentsLoaded:
    """A rank joined the generation with a checkpoint whose amendments are these (each with its position)."""

    job: str
    generation: int
    amendments: tuple[Amendment, ...]


@dataclasses.dataclass(frozen=True)
class GenerationAmended:
    """The generation started: it deals with these amendments, each from its position."""

    job: str
    generation: int
    amendments: tuple[Amendment, ...]


@dataclasses.dataclass(frozen=True)
class StepCommitted:
    """A fault-tolerant job's step committed (``croupier.core.ftsteps``): `run` (a start of the job that
    resumed step `resumed` of run `parent`, sizing steps by `mode` and `batch`) trained stream
    positions [start, stop) in `step`, split over `participants` groups of quorum `quorum`."""

    job: str
    run: str
    parent: str
    resumed: int
    mode: str
    batch: int
    step: int
    start: int
    stop: int
    quorum: int
    participants: int


@dataclasses.dataclass(frozen=True)
class EpochCut:
    """The trainer of the generation cut `epoch` short (``set_epoch`` of the next before it ended) after
    `micro` micro-batches of the rank with the most: its steps of the next epoch follow from there. Decided
    from a checkpoint whose step says so (``croupier.server._decide``)."""

    job: str
    generation: int
    epoch: int
    micro: int


Event = (JobRegistered | GenerationOpened | RankJoined | GenerationStarted | ProgressReported | CheckpointRecorded
         | BatchesDealt | BatchesCommitted | AmendmentRecorded | AmendmentsLoaded | GenerationAmended | StepCommitted
         | EpochCut)

# --------------------------------------------------------------------------- versions

#: The format of an encoded event and of a snapshot, written into each as ``"version"``.
#: Journals outlive releases: a release that changes either format MUST bump this, and MUST
#: still read every older version or refuse it with an error naming both versions
#: (tests/fixtures/journal-v2.db is a journal of version 2). Version 1 was croupier 0.1's, whose
#: journal records had no version at all. Version 5 added the AmendmentRecorded, AmendmentsLoaded
#: and GenerationAmended events and each job's ``amendments``, ``held`` and ``loaded`` in
#: snapshots. Version 4 added dynamic dealing's BatchesDealt and
#: BatchesCommitted events and each job's ``deals`` in snapshots. Version 3 added the ProgressReported and
#: CheckpointRecorded events and each job's ``progress`` and ``checkpoints`` in snapshots; a
#: version 2 journal is read as it is (its jobs have neither). Each event and snapshot also carries the
#: ``ORDER_VERSION`` its specs' orders were computed with: the generations' resume points are
#: positions of those orders, so a journal of another order version is refused, not re-mapped.
#: Version 6 added the step ledger's fields: the step, parent generation and step schedule of
#: RankJoined and GenerationStarted, the items of CheckpointRecorded (records of older versions
#: have none: the fields read as None), and each job's ``ledger`` and its generation's ``steps``
#: in snapshots. Version 7 added the StepCommitted event (a fault-tolerant job's committed steps) and
#: each job's ``steps`` in snapshots. Version 8 added the time of GenerationStarted (``at_ms``; an older
#: record has none: it reads as None, and its segment's time as 0, not known). Version 9 added the
#: EpochCut event and the ``cuts`` of each segment of a job's ``ledger`` in snapshots (an older
#: snapshot's segments have none: no cut recorded).
FORMAT_VERSION = 9
#: Every format version this croupier reads.
READS = (2, 3, 4, 5, 6, 7, 8, 9)


class FormatError(ValueError):
    """An encoded event or snapshot that this croupier cannot read; the message says what is wrong."""


def check_version(what: str, d: Mapping[str, Any]) -> None:
    """Refuses a record or snapshot `d` (which has a ``"version"``) of a format or order version this croupier does not read."""
    v = check_int(f"{what} format version", d["version"], None, None, FormatError)
    if v not in READS:
        newer = "; a newer croupier wrote it" if v > FORMAT_VERSION else ""
        raise FormatError(
            f"{what} format version {v} is not one this croupier reads (it reads versions "
            f"{', '.join(map(str, READS))}){newer}"
        )
    order = d.get("order")
    if order != ORDER_VERSION:
        raise FormatError(
            f"{what} was written with order version {show(order)}, but this croupier computes order version "
            f"{ORDER_VERSION}: the positions it stores would name other samples; recover it with the release "
            "that wrote it, or start the coordinator on a new store (the jobs resume from their checkpoints)"
        )


# --------------------------------------------------------------------------- readers of plain values


def show(v: Any) -> str:
    """`v` as an error message quotes it: its repr, cut at 80 characters."""
    text = repr(v)
    return text if len(text) <= 80 else f"{text[:77]}..."


def as_str(what: str, v: Any) -> str:
    if not isinstance(v, str):
        raise FormatError(f"{what} must be a str (got {what}={show(v)})")
    return v


def as_int(what: str, v: Any) -> int:
    return check_int(what, v, None, None, FormatError)


def as_list(what: str, v: Any, length: int | None = None) -> list[Any]:
    if not isinstance(v, (list, tuple)) or (length is not None and len(v) != length):
        shape = "a list" if length is None else f"a list of {length}"
        raise FormatError(f"{what} must be {shape} (got {what}={show(v)})")
    return list(v)


def as_map(what: str, v: Any, keys: Sequence[str]) -> Mapping[str, Any]:
    """``v`` after checking it is a map with exactly ``keys``."""
    if not isinstance(v, Mapping):
        raise FormatError(f"{what} must be a map (got {type(v).__name__})")
    missing = [k for k in keys if k not in v]
    extra = sorted(repr(k) for k in v if k not in keys)
    if missing or extra:
        raise FormatError(
            f"{what} must have the fields {list(keys)} (missing {missing}, unknown [{', '.join(extra)}])"
        )
    return v


def as_spec(what: str, v: Any) -> Spec:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        raise FormatError(f"{what} must be a map of spec fields (got {what}={show(v)})")
    try:
        return Spec.from_dict(v)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{what} is not a valid spec: {exc}") from exc


def as_cursor(what: str, v: Any) -> Cursor:
    epoch, remaining, base_world = as_list(f"{what} (a cursor [epoch, intervals, base world])", v, 3)
    intervals: list[tuple[int, int]] = []
    for i, pair in enumerate(as_list(f"{what} intervals", remaining)):
        a, b = as_list(f"{what} interval {i}", pair, 2)
        intervals.append((as_int(f"{what} interval {i} start", a), as_int(f"{what} interval {i} end", b)))
    return Cursor(as_int(f"{what} epoch", epoch), tuple(intervals), as_int(f"{what} base world", base_world))


def as_ints(what: str, v: Any) -> tuple[int, ...]:
    return tuple(as_int(f"{what}[{i}]", x) for i, x in enumerate(as_list(what, v)))


def as_amendments(what: str, v: Any) -> tuple[Amendment, ...]:
    out = []
    for i, a in enumerate(as_list(what, v)):
        try:
            out.append(Amendment.from_list(a))
        except ValueError as e:
            raise FormatError(f"{what}[{i}] is not an amendment: {e}") from None
    return tuple(out)


def amendments_to(v: tuple[Amendment, ...]) -> list[Any]:
    """Amendments as the journal and the snapshot write them: ``[[kind, values, at], ...]``."""
    return [a.to_list() for a in v]


def cursor_to(c: Cursor | None) -> Any:
    """A cursor as the journal and the snapshot write it: ``[epoch, [[start, end], ...], base world]``."""
    return None if c is None else [c.epoch, [[a, b] for a, b in c.remaining], c.base_world]


# --------------------------------------------------------------------------- the schema


@dataclasses.dataclass(frozen=True)
class Codec:
    """How a field of one type is written into a journal record and read back.

    Attributes:
        annotation: The annotated type of the event fields it writes, as the dataclass spells it.
        encode: The value -> what msgpack writes.
        decode: (what, written value) -> the value; raises FormatError naming `what`.
    """

    annotation: str
    encode: Callable[[Any], Any]
    decode: Callable[[str, Any], Any]


def _same(v: Any) -> Any:
    return v


def _optional(codec: Codec) -> Codec:
    """`codec`, or None written as nil."""
    def encode(v: Any) -> Any:
        return None if v is None else codec.encode(v)

    def decode(what: str, v: Any) -> Any:
        return None if v is None else codec.decode(what, v)

    return Codec(f"{codec.annotation} | None", encode, decode)


STR = Codec("str", _same, as_str)
INT = Codec("int", _same, as_int)
OPT_INT = _optional(INT)
SPEC = Codec("Spec", Spec.to_dict, as_spec)
CURSOR = Codec("Cursor", cursor_to, as_cursor)
OPT_CURSOR = _optional(CURSOR)
INTS = Codec("tuple[int, ...]", list, as_ints)
AMENDMENTS = Codec("tuple[Amendment, ...]", amendments_to, as_amendments)
OPT_AMENDMENTS = _optional(AMENDMENTS)
OPT_INTS = _optional(INTS)


@dataclasses.dataclass(frozen=True)
class EventSchema:
    """One row of :data:`SCHEMA`: an event's tag on disk, its type, and its fields in record order."""

    tag: str
    type: type
    fields: tuple[tuple[str, Codec], ...]
    #: field -> the key a record stores it under, for a field renamed since records were written
    keys: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: field -> the format version that added it: a record of an older version has no such key, and
    #: the field reads as None
    since: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def key(self, name: str) -> str:
        """The key a record stores field `name` under (its name unless :attr:`keys` maps it)."""
        return self.keys.get(name, name)


_JOB, _GEN, _RANK = ("job", STR), ("generation", INT), ("rank", INT)

#: The journal's events: tag, type, and (field, codec) in the order a record holds them. A new
#: event or field is a new row or entry here (and a FORMAT_VERSION bump: see above).
SCHEMA: tuple[EventSchema, ...] = (
    EventSchema("JobRegistered", JobRegistered, (_JOB, ("spec", SPEC))),
    # NOTE: GenerationOpened.incarnation is stored under "token", its name when the journal's
    # format was set: renaming a field must not change the records on disk (nor read old ones
    # differently), so the key is mapped here rather than the format version bumped.
    EventSchema("GenerationOpened", GenerationOpened, (_JOB, _GEN, ("world", INT), ("incarnation", STR)),
                keys={"incarnation": "token"}),
    EventSchema("RankJoined", RankJoined, (_JOB, _GEN, _RANK, ("resume", OPT_CURSOR), ("epoch", OPT_INT),
                                           ("step", OPT_INT), ("parent", OPT_INT), ("schedule", OPT_INTS)),
                since={"step": 6, "parent": 6, "schedule": 6}),
    EventSchema("GenerationStarted", GenerationStarted, (_JOB, _GEN, ("start", CURSOR), ("step", OPT_INT),
                                                         ("parent", OPT_INT), ("schedule", OPT_INTS), ("at_ms", OPT_INT)),
                since={"step": 6, "parent": 6, "schedule": 6, "at_ms": 8}),
    EventSchema("ProgressReported", ProgressReported,
                (_JOB, _GEN, _RANK, ("epoch", INT), ("batches", INT), ("at_ms", INT))),
    EventSchema("CheckpointRecorded", CheckpointRecorded,
                (_JOB, _GEN, _RANK, ("step", OPT_INT), ("cursor", CURSOR), ("origin", STR), ("at_ms", INT),
                 ("items", OPT_INT)), since={"items": 6}),
    EventSchema("BatchesDealt", BatchesDealt, (_JOB, _GEN, _RANK, ("epoch", INT), ("first", INT), ("count", INT))),
    EventSchema("BatchesCommitted", BatchesCommitted, (_JOB, _GEN, _RANK, ("epoch", INT), ("batches", INT))),
    EventSchema("AmendmentRecorded", AmendmentRecorded, (_JOB, ("kind", STR), ("values", INTS))),
    EventSchema("AmendmentsLoaded", AmendmentsLoaded, (_JOB, _GEN, ("amendments", AMENDMENTS))),
    EventSchema("GenerationAmended", GenerationAmended, (_JOB, _GEN, ("amendments", AMENDMENTS))),
    EventSchema("StepCommitted", StepCommitted,
                (_JOB, ("run", STR), ("parent", STR), ("resumed", INT), ("mode", STR), ("batch", INT), ("step", INT),
                 ("start", INT), ("stop", INT), ("quorum", INT), ("participants", INT))),
    EventSchema("EpochCut", EpochCut, (_JOB, _GEN, ("epoch", INT), ("micro", INT))),
)


def check_schema(schema: Sequence[EventSchema]) -> None:
    """Refuses a schema that does not describe every event exactly.

    Raises:
        TypeError: A tag twice, an event type of the ``Event`` union without a row (or a row of
            another type), or a row whose fields are not its type's fields in order, each with
            the codec of the field's annotated type; the message names the event and the field.
    """
    tags = [row.tag for row in schema]
    twice = sorted({t for t in tags if tags.count(t) > 1})
    if twice:
        raise TypeError(f"the journal schema has the tags {twice} twice")
    events, rows = set(typing.get_args(Event)), {row.type for row in schema}
    if events != rows:
        missing = sorted(t.__name__ for t in events - rows)
        extra = sorted(t.__name__ for t in rows - events)
        raise TypeError(f"the journal schema must have one row per event (no row: {missing}; not an event: {extra})")
    for row in schema:
        fields = [(f.name, str(f.type)) for f in dataclasses.fields(row.type)]
        table = [(name, codec.annotation) for name, codec in row.fields]
        if [n for n, _ in fields] != [n for n, _ in table]:
            gone = [n for n, _ in fields if n not in dict(table)]
            unknown = [n for n, _ in table if n not in dict(fields)]
            why = "; ".join([*([f"not in the table: {gone}"] if gone else []),
                             *([f"not in the event: {unknown}"] if unknown else [])]) or "another order"
            raise TypeError(f"the journal schema's {row.tag} has the fields {[n for n, _ in table]}, its event "
                            f"{[n for n, _ in fields]} ({why})")
        for (name, annotation), (_, written) in zip(fields, table, strict=True):
            if annotation != written:
                raise TypeError(f"the journal schema writes {row.tag}.{name} as {written}, but the field is {annotation}")


check_schema(SCHEMA)
_BY_TAG: dict[str, EventSchema] = {row.tag: row for row in SCHEMA}
_BY_TYPE: dict[type, EventSchema] = {row.type: row for row in SCHEMA}


# --------------------------------------------------------------------------- the codec


def encode_event(ev: Event) -> dict[str, Any]:
    """A plain (msgpack-able) dict of an event: its ``type`` (tag), the format ``version``, the
    ``order`` version, and its fields in :data:`SCHEMA`'s order, each under its stored key.

    Raises:
        TypeError: If `ev` is not an event.
    """
    row = _BY_TYPE.get(type(ev))
    if row is None:
        raise TypeError(f"not an event: {ev!r}")
    d: dict[str, Any] = {"type": row.tag, "version": FORMAT_VERSION, "order": ORDER_VERSION}
    for name, codec in row.fields:
        d[row.key(name)] = codec.encode(getattr(ev, name))
    return d


def decode_event(d: Any) -> Event:
    """Inverse of :func:`encode_event`; refuses anything :func:`encode_event` would not have written.

    Args:
        d: A decoded event, e.g. what msgpack read back from a journal record.

    Returns:
        The event.

    Raises:
        FormatError: If ``d`` is not a map, has no or another format version, an unknown
            ``type``, a missing or unknown field, or a field of the wrong type.
    """
    if not isinstance(d, Mapping):
        raise FormatError(f"an event must be a map (got {type(d).__name__})")
    if "version" not in d:
        raise FormatError(f"the event has no format version (fields: [{', '.join(sorted(map(repr, d)))}])")
    check_version("event", d)
    tag = d.get("type")
    row = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if row is None:
        raise FormatError(f"unknown event type {show(tag)} (known: {sorted(_BY_TAG)})")
    version = d["version"]
    fields = [(name, codec) for name, codec in row.fields if row.since.get(name, 0) <= version]
    body = as_map(f"a {tag} event", d, ["type", "version", "order", *(row.key(name) for name, _ in fields)])
    values = {name: codec.decode(f"{tag}.{row.key(name)}", body[row.key(name)]) for name, codec in fields}
    return row.type(**values)  # type: ignore[no-any-return]
