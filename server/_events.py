"""The coordinator's events and their codec: one schema, read from the event types themselves.

Each event is a frozen dataclass; its fields' annotated types are the schema: :data:`_DECODERS`
holds one reader per field type, and ``encode_event`` / ``decode_event`` walk the fields of the
event's type, so a field added to an event is encoded and checked on the way back with no
decoder of its own (a type the table does not know fails at import). The snapshot's restore in
``croupier.server._state`` reads its values with the same readers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from croupier.core.cursor import Cursor
from croupier.core.spec import ORDER_VERSION, Spec

# --------------------------------------------------------------------------- requests and events


@dataclasses.dataclass(frozen=True)
class JobRegistered:
    job: str
    spec: Spec


@dataclasses.dataclass(frozen=True)
class GenerationOpened:
    job: str
    generation: int
    world: int
    token: str


@dataclasses.dataclass(frozen=True)
class RankJoined:
    job: str
    generation: int
    rank: int
    resume: Cursor | None
    epoch: int | None


@dataclasses.dataclass(frozen=True)
class GenerationStarted:
    job: str
    generation: int
    start: Cursor


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


Event = (JobRegistered | GenerationOpened | RankJoined | GenerationStarted | ProgressReported | CheckpointRecorded
         | BatchesDealt | BatchesCommitted)
_EVENT_TYPES: dict[str, type] = {
    t.__name__: t
    for t in (JobRegistered, GenerationOpened, RankJoined, GenerationStarted, ProgressReported, CheckpointRecorded,
              BatchesDealt, BatchesCommitted)
}


def _cursor_to(c: Cursor | None) -> Any:
    return None if c is None else [c.epoch, [[a, b] for a, b in c.remaining], c.base_world]


# --------------------------------------------------------------------------- encoding

#: The format of an encoded event and of a snapshot, written into each as ``"version"``.
#: Journals outlive releases: a release that changes either format MUST bump this, and MUST
#: still read every older version or refuse it with an error naming both versions
#: (tests/fixtures/journal-v2.db is a journal of version 2). Version 1 was croupier 0.1's, whose
#: journal records had no version at all. Version 4 added dynamic dealing's BatchesDealt and
#: BatchesCommitted events and each job's ``deals`` in snapshots. Version 3 added the ProgressReported and
#: CheckpointRecorded events and each job's ``progress`` and ``checkpoints`` in snapshots; a
#: version 2 journal is read as it is (its jobs have neither). Each event and snapshot also carries the
#: ``ORDER_VERSION`` its specs' orders were computed with: the generations' resume points are
#: positions of those orders, so a journal of another order version is refused, not re-mapped.
FORMAT_VERSION = 4
#: Every format version this croupier reads.
READS = (2, 3, 4)


class FormatError(ValueError):
    """An encoded event or snapshot that this croupier cannot read; the message says what is wrong."""


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _as_str(what: str, v: Any) -> str:
    if not isinstance(v, str):
        raise FormatError(f"{what} must be a str (got {what}={_show(v)})")
    return v


def _as_int(what: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{what} must be an int (got {what}={_show(v)})")
    return v


def _as_list(what: str, v: Any, length: int | None = None) -> list[Any]:
    if not isinstance(v, (list, tuple)) or (length is not None and len(v) != length):
        shape = "a list" if length is None else f"a list of {length}"
        raise FormatError(f"{what} must be {shape} (got {what}={_show(v)})")
    return list(v)


def _as_map(what: str, v: Any, keys: Sequence[str]) -> Mapping[str, Any]:
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


def _as_spec(what: str, v: Any) -> Spec:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) for k in v):
        raise FormatError(f"{what} must be a map of spec fields (got {what}={_show(v)})")
    try:
        return Spec.from_dict(v)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{what} is not a valid spec: {exc}") from exc


def _as_cursor(what: str, v: Any) -> Cursor:
    epoch, remaining, base_world = _as_list(f"{what} (a cursor [epoch, intervals, base world])", v, 3)
    intervals: list[tuple[int, int]] = []
    for i, pair in enumerate(_as_list(f"{what} intervals", remaining)):
        a, b = _as_list(f"{what} interval {i}", pair, 2)
        intervals.append((_as_int(f"{what} interval {i} start", a), _as_int(f"{what} interval {i} end", b)))
    return Cursor(_as_int(f"{what} epoch", epoch), tuple(intervals), _as_int(f"{what} base world", base_world))


_Decoder = Callable[[str, Any], Any]


def _optional(decode: _Decoder) -> _Decoder:
    def decode_optional(what: str, v: Any) -> Any:
        return None if v is None else decode(what, v)

    return decode_optional


#: How a value of each field type of an event is read back, by the field's annotation.
_DECODERS: dict[str, _Decoder] = {
    "str": _as_str,
    "int": _as_int,
    "int | None": _optional(_as_int),
    "Spec": _as_spec,
    "Cursor": _as_cursor,
    "Cursor | None": _optional(_as_cursor),
}
#: Event type name -> its fields and how each is read back (a KeyError here: teach _DECODERS the type).
_EVENT_FIELDS: dict[str, dict[str, _Decoder]] = {
    name: {f.name: _DECODERS[str(f.type)] for f in dataclasses.fields(t)} for name, t in _EVENT_TYPES.items()
}


def _check_version(what: str, d: Mapping[str, Any]) -> None:
    v = d["version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise FormatError(f"{what} format version must be an int (got {_show(v)})")
    if v not in READS:
        newer = "; a newer croupier wrote it" if v > FORMAT_VERSION else ""
        raise FormatError(
            f"{what} format version {v} is not one this croupier reads (it reads versions "
            f"{', '.join(map(str, READS))}){newer}"
        )
    order = d.get("order")
    if order != ORDER_VERSION:
        raise FormatError(
            f"{what} was written with order version {_show(order)}, but this croupier computes order version "
            f"{ORDER_VERSION}: the positions it stores would name other samples; recover it with the release "
            "that wrote it, or start the coordinator on a new store (the jobs resume from their checkpoints)"
        )


def encode_event(ev: Event) -> dict[str, Any]:
    """A plain (msgpack-able) dict of an event: its ``type``, the format ``version``, and its fields."""
    d: dict[str, Any] = {"type": type(ev).__name__, "version": FORMAT_VERSION, "order": ORDER_VERSION}
    for f in dataclasses.fields(ev):
        v = getattr(ev, f.name)
        if isinstance(v, Spec):
            v = v.to_dict()
        elif isinstance(v, Cursor):
            v = _cursor_to(v)
        d[f.name] = v
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
    _check_version("event", d)
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in _EVENT_FIELDS:
        raise FormatError(f"unknown event type {_show(kind)} (known: {sorted(_EVENT_FIELDS)})")
    fields = _EVENT_FIELDS[kind]
    body = _as_map(f"a {kind} event", d, ["type", "version", "order", *fields])
    kw = {name: decode(f"{kind}.{name}", body[name]) for name, decode in fields.items()}
    return _EVENT_TYPES[kind](**kw)  # type: ignore[no-any-return]
