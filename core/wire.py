"""Conversions between the domain types and API v1 messages (the gRPC settings of each end are its own)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from croupier.core.amend import Amendment
from croupier.core.api import CheckpointRecord
from croupier.core.checks import check_choice
from croupier.core.cursor import Cursor
from croupier.core.errors import InvalidArgument
from croupier.core.schedule import Schedule
from croupier.core.spec import TOKEN_WINDOW, Spec
from croupier.v1 import coordinator_pb2 as pb

SERVICE = "croupier.v1.Coordinator"


def spec_to_proto(s: Spec) -> pb.Spec:
    m = pb.Spec(
        n=s.n, seed=s.seed, permutation=s.permutation, partition=s.partition, tail=s.tail, scope=s.scope,
        batch_size=s.batch_size, drop_last_batch=s.drop_last_batch, even_batches=s.even_batches,
    )
    if s.buffer_size is not None:
        m.buffer_size = s.buffer_size
    if s.pack_size is not None:
        m.pack_size = s.pack_size
    if s.lengths is not None:
        m.lengths = s.lengths
    if s.max_tokens is not None:
        m.max_tokens = s.max_tokens
    if s.cost != "sum":
        m.cost = s.cost
    if s.token_window != TOKEN_WINDOW:
        m.token_window = s.token_window
    if s.dealing != "static":
        m.dealing = s.dealing
    if s.sources is not None:
        m.sources.extend(s.sources)
        m.weights.extend(pb.WeightChange(position=at, parts=parts) for at, parts in s.weights or ())
        m.max_epochs.extend(s.max_epochs or ())
    if s.shards is not None:
        m.shards = s.shards
        m.shard_window = s.shard_window
        m.lanes = s.lanes
        m.reader_group = s.reader_group
    return m


def spec_from_proto(m: pb.Spec) -> Spec:
    """The Spec a message describes; InvalidArgument (naming the value) if it is not a valid one."""
    try:
        return Spec(
            n=m.n, seed=m.seed, permutation=m.permutation, partition=m.partition, tail=m.tail,
            scope=m.scope or "global",
            buffer_size=m.buffer_size if m.HasField("buffer_size") else None,
            pack_size=m.pack_size if m.HasField("pack_size") else None,
            batch_size=m.batch_size, drop_last_batch=m.drop_last_batch, even_batches=m.even_batches,
            lengths=m.lengths if m.HasField("lengths") else None,
            max_tokens=m.max_tokens if m.HasField("max_tokens") else None,
            cost=m.cost or "sum",
            token_window=m.token_window if m.HasField("token_window") else TOKEN_WINDOW,
            dealing=m.dealing or "static",
            sources=tuple(m.sources) if m.sources else None,
            weights=tuple((w.position, tuple(w.parts)) for w in m.weights) if m.weights else None,
            max_epochs=tuple(m.max_epochs) if m.max_epochs else None,
            shards=m.shards if m.HasField("shards") else None,
            shard_window=m.shard_window if m.HasField("shard_window") else 32,
            lanes=m.lanes if m.HasField("lanes") else 16,
            reader_group=m.reader_group if m.HasField("reader_group") else 1,
        )
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"invalid spec: {e}") from None


def amendment_to_proto(a: Amendment) -> pb.Amendment:
    m = pb.Amendment(kind=a.kind, values=a.values)
    if a.at is not None:
        m.at = a.at
    return m


def amendment_from_proto(m: pb.Amendment) -> Amendment:
    """The Amendment a message describes; InvalidArgument (naming the value) if it is not one."""
    try:
        return Amendment.from_list([m.kind, list(m.values), m.at if m.HasField("at") else None])
    except ValueError as e:
        raise InvalidArgument(f"invalid amendment: {e}") from None


def cursor_to_proto(c: Cursor) -> pb.Cursor:
    flat = np.array(c.remaining, dtype="<i8").reshape(-1)  # (2k,)
    return pb.Cursor(epoch=c.epoch, remaining=flat.tobytes(), base_world=c.base_world)


def cursor_from_proto(m: pb.Cursor) -> Cursor:
    if len(m.remaining) % 16:
        raise InvalidArgument(f"cursor.remaining must be int64 pairs, a multiple of 16 bytes (got {len(m.remaining)} bytes)")
    flat = np.frombuffer(m.remaining, dtype="<i8").reshape(-1, 2)  # (k, 2)
    return Cursor(int(m.epoch), tuple((int(a), int(b)) for a, b in flat.tolist()), int(m.base_world))


def record_to_proto(r: CheckpointRecord) -> pb.CheckpointRecord:
    m = pb.CheckpointRecord(generation=r.generation, rank=r.rank, recorded_unix_ms=r.recorded_ms)
    m.checkpoint.CopyFrom(checkpoint_to_proto(r.step, r.cursor, r.origin, r.items))
    m.amendments.extend(amendment_to_proto(a) for a in r.amendments)
    return m


def record_from_proto(m: pb.CheckpointRecord) -> CheckpointRecord:
    step, cursor, origin = checkpoint_from_proto(m.checkpoint)
    if cursor is None:
        raise InvalidArgument("a checkpoint record without its cursor")
    return CheckpointRecord(step, cursor, origin, m.generation, m.rank, m.recorded_unix_ms,
                            tuple(amendment_from_proto(a) for a in m.amendments), items_from_proto(m.checkpoint))


def checkpoint_to_proto(step: int | None, cursor: Cursor | None, origin: str, items: int | None = None) -> pb.Checkpoint:
    m = pb.Checkpoint(origin=origin)
    if items is not None:
        m.items = items
    if cursor is not None:
        m.cursor.CopyFrom(cursor_to_proto(cursor))
    if step is not None:
        m.step = step
    return m


def checkpoint_from_proto(m: pb.Checkpoint) -> tuple[int | None, Cursor | None, str]:
    cursor = cursor_from_proto(m.cursor) if m.HasField("cursor") else None
    return (m.step if m.HasField("step") else None), cursor, m.origin


def items_from_proto(m: pb.Checkpoint) -> int | None:
    """The items a reported checkpoint names (None: not named)."""
    return m.items if m.HasField("items") else None


def schedule_to_proto(s: Schedule) -> list[int]:
    """A step schedule as JoinRequest.schedule carries it (empty for the default)."""
    return [] if s == Schedule() else s.to_list()


def schedule_from_proto(values: Sequence[int]) -> Schedule:
    """The schedule JoinRequest.schedule names; InvalidArgument (naming it) when it is not one."""
    if not values or not any(values):
        return Schedule()
    if len(values) != 4:
        raise InvalidArgument(f"schedule must be [global batch, ramp-up start, increment, steps] (got {list(values)})")
    return Schedule.from_list([int(v) for v in values])


def pack_runs(runs: Sequence[tuple[int, int]]) -> bytes:
    """Dynamic dealing's runs of global batches (first, count) as little-endian int64 pairs."""
    return np.asarray(runs, dtype="<i8").reshape(-1).tobytes()


def unpack_runs(data: bytes) -> tuple[tuple[int, int], ...]:
    """Inverse of :func:`pack_runs`; InvalidArgument for bytes that are not int64 pairs."""
    if len(data) % 16:
        raise InvalidArgument(f"dealt runs must be int64 pairs (got {len(data)} bytes)")
    flat = np.frombuffer(data, dtype="<i8").tolist()
    return tuple(zip(flat[::2], flat[1::2]))


def itemsize_for(n: int) -> int:
    """Bytes per index on the wire: 4 while every index fits in uint32, else 8."""
    return 4 if n <= 2**32 else 8


def pack_indices(indices: np.ndarray, n: int) -> tuple[bytes, int]:
    """(indices as little-endian bytes, itemsize) for a job of n samples."""
    size = itemsize_for(n)
    return np.ascontiguousarray(indices, dtype="<u4" if size == 4 else "<i8").tobytes(), size


def unpack_indices(data: bytes, itemsize: int) -> np.ndarray:
    """Inverse of :func:`pack_indices`: an int64 array."""
    check_choice("itemsize", itemsize, (4, 8))
    return np.frombuffer(data, dtype="<u4" if itemsize == 4 else "<i8").astype(np.int64)


