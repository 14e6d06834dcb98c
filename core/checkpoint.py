"""The checkpoint state: a small, versioned, topology-free dict naming a position in a job's data order."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from croupier.core.amend import Amendment
from croupier.core.checks import check_int, is_int
from croupier.core.cursor import Cursor, validate_cursor
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.spec import ORDER_VERSION, Spec

#: The format of the checkpoint state this release writes. Format 3 added ``items``; format 4 is
#: format 3 with a mixture's ``sources`` (the sizes the job's spec has, so that a sampler made on
#: grown sources finds the spec the state was saved with) and its ``amendments``. A mixture's state
#: is format 4, any other format 3 (so a release that reads format 3 refuses a mixture's state by
#: its version, not by an unknown key).
VERSION = 3
WITH_AMENDMENTS = 4
#: Formats this release reads: format 2 is format 3 without ``items``.
READS = (2, 3, 4)
#: Formats of earlier releases it refuses: format version -> (the release that wrote it, its order version).
#: Format 1 had no ``order`` key; its orders are order version 1.
PAST_FORMATS: dict[int, tuple[str, int]] = {1: ("croupier 0.1", 1)}
_KEYS = {"version", "order", "job", "fingerprint", "epoch", "remaining", "base_world"}
#: Keys a state may carry beyond the cursor: ``items`` counts what the checkpointing rank had
#: taken of the state's epoch (format 3); ``origin`` names the checkpoint for the audit log.
_OPTIONAL = {"items", "origin", "amendments", "sources"}


def to_state(job: str, spec: Spec, cursor: Cursor, items: int | None = None, origin: str | None = None,
             amendments: tuple[Amendment, ...] = ()) -> dict[str, Any]:
    """The checkpoint state of `job` at `cursor`: what a sampler's ``state_dict()`` returns.

    It names positions of the epoch's order, not per-rank lists, so it loads under any world
    size; it holds one interval for strided partitions and at most one per rank otherwise.

    Args:
        items: The items (indices, or batches) of the cursor's epoch the checkpointing rank had
            taken, as its ``len()`` counts them: a resumed sampler's ``len()`` and ``items_done``
            go on from it. None when not known (a state made without a sampler).
        origin: Names the checkpoint for the audit log (``incarnation/epoch/items``).
        amendments: A mixture's amendments that hold (each with its position): a job whose
            coordinator lost its store takes them back from the state.
    """
    state: dict[str, Any] = {
        "version": VERSION if spec.sources is None else WITH_AMENDMENTS,
        "order": ORDER_VERSION,
        "job": job,
        "fingerprint": spec.fingerprint,
        "epoch": cursor.epoch,
        "remaining": [[a, b] for a, b in cursor.remaining],
        "base_world": cursor.base_world,
    }
    if items is not None:
        state["items"] = items
    if origin is not None:
        state["origin"] = origin
    if spec.sources is not None:
        state["sources"] = list(spec.sources)
    if amendments:
        state["amendments"] = [a.to_list() for a in amendments]
    return state


def spec_of(spec: Spec, state: Mapping[str, Any]) -> Spec:
    """The spec a mixture's `state` was saved with, when `spec` is the same but for grown sources (a
    sampler made on a dataset whose sources grew since); else `spec`."""
    saved = state.get("sources") if isinstance(state, Mapping) else None
    if spec.sources is None or not isinstance(saved, list) or tuple(saved) == spec.sources:
        return spec
    if not all(is_int(x) for x in saved) or len(saved) != len(spec.sources):
        return spec
    ns = (spec.n, sum(saved)) if spec.n == sum(spec.sources) else (spec.n,)
    for n in ns:
        try:
            cand = dataclasses.replace(spec, sources=tuple(saved), n=n)
        except ValueError:
            continue
        if cand.fingerprint == state.get("fingerprint"):
            return cand
    return spec


def amendments_of(state: Mapping[str, Any]) -> tuple[Amendment, ...]:
    """The amendments a checkpoint state carries (none for a state without them).

    Raises:
        InvalidArgument: they are not a list of ``[kind, values, at]`` with their positions.
    """
    raw = state.get("amendments", []) if isinstance(state, Mapping) else []
    if state.get("version") != WITH_AMENDMENTS and raw:
        raise InvalidArgument(f"checkpoint state format {state.get('version')!r} has no amendments "
                              f"(format {WITH_AMENDMENTS} has)")
    if not isinstance(raw, (list, tuple)):
        raise InvalidArgument(f"checkpoint state's amendments must be a list (got {raw!r})")
    try:
        out = tuple(Amendment.from_list(a) for a in raw)
    except ValueError as e:
        raise InvalidArgument(f"checkpoint state's amendments are malformed: {e}") from None
    if any(a.at is None for a in out):
        raise InvalidArgument("checkpoint state's amendments must each hold from a position (at)")
    return out


def from_state(job: str, spec: Spec, state: Mapping[str, Any]) -> Cursor | None:
    """Reads a checkpoint state for `job` with `spec`; an empty mapping means "no state" (None).

    Raises:
        InvalidArgument: the state is malformed (missing keys, wrong types, bad intervals).
        FailedPrecondition: the state belongs to another job or another spec, or it is of
            another format or order version than this release's (the message names both).
    """
    if not isinstance(state, Mapping):
        raise InvalidArgument(f"checkpoint state must be a dict (got {type(state).__name__})")
    if not state:
        return None
    # The format comes first: an older format has other keys, and is refused by its version.
    if "version" in state and state["version"] not in READS:
        raise FailedPrecondition(_other_format(state))
    missing = sorted(_KEYS - set(state))
    unknown = sorted(set(state) - _KEYS - _OPTIONAL)
    if missing or unknown:
        raise InvalidArgument(f"checkpoint state has missing keys {missing} and unknown keys {unknown} (got {dict(state)!r})")
    order_version = state["order"]
    check_int("checkpoint state's order version", order_version, None, None, InvalidArgument)
    if order_version != ORDER_VERSION:
        raise FailedPrecondition(
            f"checkpoint state has order version {order_version} (format {VERSION}): the positions it names "
            f"belong to another release's orders, not to this one's; this release reads format {VERSION} "
            f"with order version {ORDER_VERSION}; {_remedy(state)}"
        )
    if state["job"] != job:
        raise FailedPrecondition(f"checkpoint state is from job {state['job']!r}, not from this job {job!r}")
    if state["fingerprint"] != spec.fingerprint:
        raise FailedPrecondition(
            f"checkpoint state was saved with spec fingerprint {state['fingerprint']!r}, but this job's spec "
            f"has fingerprint {spec.fingerprint!r} ({spec.describe()})"
        )
    try:
        remaining = tuple(tuple(iv) for iv in state["remaining"])
        cursor = Cursor(epoch=state["epoch"], remaining=remaining, base_world=state["base_world"])
        validate_cursor(spec, cursor)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"checkpoint state is malformed: {e}") from None
    if "items" in state:
        items = state["items"]
        check_int("checkpoint state's items", items, 0, None, InvalidArgument)
    return cursor


def items_of(state: Mapping[str, Any], cursor: Cursor | None) -> int | None:
    """The items of `cursor`'s epoch the checkpointing rank had taken, from a state :func:`from_state` read.

    Format 3 carries them as ``items``. A format-2 state (G9: it keeps loading) named them only
    in its origin, ``incarnation/epoch/items``, which is read here, for that format alone.
    """
    if cursor is None:
        return None
    if state.get("version") != 2:
        items = state.get("items")
        return items if isinstance(items, int) else None
    return _origin_items(state.get("origin"), cursor.epoch)


def state_of_record(job: str, spec: Spec, cursor: Cursor, origin: str,
                    amendments: tuple[Amendment, ...] = ()) -> dict[str, Any]:
    """The checkpoint state of a record the coordinator keeps (a cursor and the origin it was saved with).

    NOTE: the coordinator's records name a checkpoint by its origin, ``incarnation/epoch/items``, which
    is where their item count is read (the journal's checkpoint events have no field of their own).
    """
    state = to_state(job, spec, cursor, origin=origin or None, amendments=amendments)
    items = _origin_items(origin, cursor.epoch)
    if items is not None:
        state["items"] = items
    return state


def _origin_items(origin: Any, epoch: int) -> int | None:
    """The item count an origin ``incarnation/epoch/items`` names for `epoch`, or None."""
    if not isinstance(origin, str):
        return None
    parts = origin.rsplit("/", 2)
    try:
        at, items = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        return None
    return items if at == epoch and items >= 0 else None


def _remedy(state: Mapping[str, Any]) -> str:
    """What to do with a state this release cannot read: start its epoch over, or go back."""
    epoch = state.get("epoch")
    if is_int(epoch) and epoch >= 0:
        again = f"restart epoch {epoch} (load an empty state and call set_epoch({epoch}))"
    else:
        again = "restart the epoch (load an empty state and call set_epoch)"
    return f"{again} or use the release that wrote it"


def _other_format(state: Mapping[str, Any]) -> str:
    """Why a state of another format version is refused, naming its versions and this release's."""
    version = state["version"]
    ours = f"this release reads format {VERSION} with order version {ORDER_VERSION}"
    if is_int(version) and version in PAST_FORMATS:
        release, order_version = PAST_FORMATS[version]
        return (f"checkpoint state format version {version} ({release}, order version {order_version}) "
                f"is from an earlier release; {ours}; {_remedy(state)}")
    if is_int(version) and version > VERSION:
        return (f"checkpoint state format version {version} (order version {state.get('order', 'unknown')}) "
                f"is newer than this release; {ours}; use the release that wrote it")
    return f"checkpoint state format version {version!r} is not a known format; {ours}"
