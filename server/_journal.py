"""What the coordinator writes to its store, and recovery: the one place journal bytes become state.

A journal record is one event and a snapshot is the whole state, each the msgpack encoding of a
versioned dict (:func:`~croupier.server._events.encode_event`, driven by the journal's schema;
:meth:`~croupier.server._state.State.snapshot`). A store verifies the bytes it holds (its
checksums); :func:`recover` verifies that they mean something to this croupier. A record whose
bytes the store vouches for but which this croupier cannot read -- not msgpack, an unknown event
type, another format version, a missing, unknown or mistyped field, an event that does not
follow the ones before it -- is :class:`StoreCorrupt` naming the store, the record's sequence
number and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import msgpack

from croupier.server._events import Event, FormatError, decode_event, encode_event
from croupier.server._state import State
from croupier.server._store import Recovered, Store, StoreCorrupt

__all__ = ["JournalRead", "pack_event", "pack_snapshot", "read_journal", "recover", "replay"]


def pack_event(ev: Event) -> bytes:
    """The journal record of one event."""
    return bytes(msgpack.packb(encode_event(ev)))


def pack_snapshot(state: State) -> bytes:
    """The snapshot payload of a whole state."""
    return bytes(msgpack.packb(state.snapshot()))


def _unpack(store: Store, what: str, payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise _corrupt(store, what, f"its {len(payload)} bytes are not msgpack ({reason})") from exc


def _corrupt(store: Store, what: str, why: str) -> StoreCorrupt:
    return StoreCorrupt(f"store {store.url} is corrupt: {what} cannot be read: {why}")


def recover(store: Store) -> tuple[State, Recovered]:
    """Loads a store and rebuilds the state it holds: its snapshot, then every record after it.

    Args:
        store: The store, open.

    Returns:
        The state, and what the store returned.

    Raises:
        StoreCorrupt: If the store could not verify its contents, or a record or the snapshot
            could not be read; the message names the store, the sequence number and why.
        StoreUnavailable: If the store could not be read.
    """
    rec = store.load()
    return replay(store, rec), rec


def replay(store: Store, rec: Recovered, state: State | None = None) -> State:
    """`state` (or the empty state) brought up to date with what a store returned: its snapshot,
    when it has one (which replaces `state`), then every record after it.

    Raises:
        StoreCorrupt: as :func:`recover`.
    """
    snapshot = _snapshot(store, rec)
    if snapshot is not None:
        state = snapshot
    elif state is None:
        state = State()
    for seq, ev in _events(store, rec):
        try:
            state.apply(ev)
        except (KeyError, RuntimeError) as exc:  # what apply raises for an event out of place
            why = f"its {type(ev).__name__} event does not follow the records before it ({type(exc).__name__}: {exc})"
            raise _corrupt(store, f"journal record {seq}", why) from exc
    return state


def _snapshot(store: Store, rec: Recovered) -> State | None:
    """The state of the snapshot `rec` holds, or None without one."""
    if rec.snapshot is None:
        return None
    what = f"the snapshot at seq {rec.snapshot_seq}"
    try:
        return State.restore(_unpack(store, what, rec.snapshot))
    except FormatError as exc:
        raise _corrupt(store, what, str(exc)) from exc


def _events(store: Store, rec: Recovered) -> Iterator[tuple[int, Event]]:
    """``(seq, event)`` of the records `rec` holds after its snapshot, each decoded as it is reached."""
    for seq, payload in rec.records:
        what = f"journal record {seq}"
        try:
            ev = decode_event(_unpack(store, what, payload))
        except FormatError as exc:
            raise _corrupt(store, what, str(exc)) from exc
        yield seq, ev


@dataclasses.dataclass(frozen=True)
class JournalRead:
    """What a store holds, decoded: the state of its snapshot (None without one) and every event after it.

    Attributes:
        snapshot: The state the latest snapshot holds, or None when the store has none.
        snapshot_seq: The last record the snapshot covers (0 without one).
        events: ``(seq, event)`` of every record after the snapshot, in journal order.
    """

    snapshot: State | None
    snapshot_seq: int
    events: list[tuple[int, Event]]


def read_journal(store: Store, since: int = 0) -> JournalRead:
    """The events a store holds after record `since`, all of them while it holds them (else its
    latest snapshot and the records after it, as :meth:`Store.read_since` says).

    The public way for tools and tests to read a journal: nothing outside this module unpacks its
    framing. The store is read, not changed.

    Raises:
        StoreCorrupt: a record or the snapshot cannot be read (the message names which, and why).
        StoreUnavailable: the store cannot be read.
    """
    rec = store.read_since(since)
    return JournalRead(_snapshot(store, rec), rec.snapshot_seq, list(_events(store, rec)))
