"""The checkpoint state: a small, versioned, topology-free dict naming a position in a job's data order."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from croupier.core.amend import Amendment
from croupier.core.api import MAX_NAME, CheckpointRecord
from croupier.core.checks import check_int, check_name, is_int
from croupier.core.cursor import Cursor, validate_cursor
from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.spec import ORDER_VERSION, Spec

#: The format of the checkpoint state this release writes. Format 3 added ``items``; format 4 is
#: format 3 with a mixture's ``sources`` (the sizes the job's spec has, so that a sampler made on
#: grown sources finds the spec the state was saved with) and its ``amendments``; format 5 is
#: format 4 with the trainer's ``step`` and the ``generation`` that took the state (with its
#: ``incarnation``): :class:`Taken`. A state that names a step or a generation is format 5, else a
#: mixture's is format 4, any other format 3 (so a release that reads an earlier format refuses a
#: later one by its version, not by an unknown key, and a state without the later keys is what
#: that release wrote).
VERSION = 3
WITH_AMENDMENTS = 4
WITH_STEPS = 5
#: Formats this release reads: format 2 is format 3 without ``items``.
READS = (2, 3, 4, 5)
#: Formats of earlier releases it refuses: format version -> (the release that wrote it, its order version).
#: Format 1 had no ``order`` key; its orders are order version 1.
PAST_FORMATS: dict[int, tuple[str, int]] = {1: ("croupier 0.1", 1)}
_KEYS = {"version", "order", "job", "fingerprint", "epoch", "remaining", "base_world"}
#: Keys a state may carry beyond the cursor: ``items`` counts what the checkpointing rank had
#: taken of the state's epoch (format 3); ``origin`` names the checkpoint for the audit log;
#: ``step``, ``generation`` and ``incarnation`` (format 5) name where it was taken (:class:`Taken`).
_TAKEN = ("step", "generation", "incarnation")
_OPTIONAL = {"items", "origin", "amendments", "sources", *_TAKEN}


@dataclasses.dataclass(frozen=True)
class Taken:
    """Where a checkpoint state was taken, as its format-5 fields name it (None: not named).

    Attributes:
        step: The trainer's global step at the checkpoint (``state_dict(step=...)``): the optimizer
            steps taken since the job's start.
        generation: The generation (numbered by the job's coordinator) whose rank took the state.
        incarnation: That generation's incarnation (the audit log's name for it).
    """

    step: int | None = None
    generation: int | None = None
    incarnation: str | None = None

    def check(self, error: type[Exception] = ValueError, where: str = "") -> None:
        """Raises `error` naming the field for a value out of its range (`where` prefixes the names)."""
        if self.step is not None:
            check_int(f"{where}step", self.step, 0, None, error)
        if self.generation is not None:
            check_int(f"{where}generation", self.generation, 1, None, error)
        if self.incarnation is not None:
            check_name(f"{where}incarnation", self.incarnation, MAX_NAME, error)

    @property
    def named(self) -> bool:
        """The state names a step or a generation (it is format 5)."""
        return self.step is not None or self.generation is not None


def to_state(job: str, spec: Spec, cursor: Cursor, items: int | None = None, origin: str | None = None,
             amendments: tuple[Amendment, ...] = (), taken: Taken = Taken()) -> dict[str, Any]:
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
        taken: The trainer's step and the generation (and its incarnation) that took the state, as
            far as known: a state that names a step or a generation is format 5.

    Raises:
        ValueError: a field of `taken` is out of its range (naming it).
    """
    taken.check()
    if taken.named:
        version = WITH_STEPS
    else:
        version = VERSION if spec.sources is None else WITH_AMENDMENTS
    state: dict[str, Any] = {
        "version": version,
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
    for key in _TAKEN:
        if getattr(taken, key) is not None:
            state[key] = getattr(taken, key)
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
    if state.get("version") not in (WITH_AMENDMENTS, WITH_STEPS) and raw:
        raise InvalidArgument(f"checkpoint state format {state.get('version')!r} has no amendments "
                              f"(formats {WITH_AMENDMENTS} and {WITH_STEPS} have)")
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
            f"checkpoint state has order version {order_version} (format {state['version']}): the positions it names "
            f"belong to another release's orders, not to this one's; this release reads format {VERSION} "
            f"with order version {ORDER_VERSION}; {_remedy(state)}"
        )
    if state["job"] != job:
        raise FailedPrecondition(f"checkpoint state is from job {state['job']!r}, not from this job {job!r}")
    if state["fingerprint"] != spec.fingerprint:
        raise FailedPrecondition(
            f"checkpoint state was saved with spec fingerprint {state['fingerprint']!r}, but this job's spec "
            f"has fingerprint {spec.fingerprint!r} ({spec.describe()}){_reader_group_hint(spec, state['fingerprint'])}"
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
    named = [k for k in _TAKEN if k in state]
    if named and state["version"] != WITH_STEPS:
        raise InvalidArgument(f"checkpoint state format {state['version']} has no {named[0]} (format {WITH_STEPS} "
                              f"has; got {named[0]}={state[named[0]]!r})")
    Taken(*(state.get(k) for k in _TAKEN)).check(InvalidArgument, "checkpoint state's ")
    return cursor


def taken_of(state: Mapping[str, Any]) -> Taken:
    """Where a checkpoint state :func:`from_state` read was taken: every field None for a state of a
    format before 5 (or an empty one)."""
    if not isinstance(state, Mapping) or state.get("version") != WITH_STEPS:
        return Taken()
    return Taken(*(state.get(k) for k in _TAKEN))


def items_of(state: Mapping[str, Any], cursor: Cursor | None) -> int | None:
    """The items of `cursor`'s epoch the checkpointing rank had taken, from a state :func:`from_state` read.

    Formats 3 and later carry them as ``items``; a format-2 state names them only in its origin
    (:func:`legacy_origin_items`).
    """
    if cursor is None:
        return None
    if state.get("version") == 2:
        return legacy_origin_items(state.get("origin"), cursor.epoch)
    items = state.get("items")
    return items if is_int(items) else None


def state_of_record(job: str, spec: Spec, record: CheckpointRecord) -> dict[str, Any]:
    """The checkpoint state of a record the coordinator keeps: its cursor, items, step, the generation
    that recorded it, its origin and its amendments, each from the record's own field (a record does
    not name the generation's incarnation: the state does not either).

    A record journaled before checkpoints carried their items (``record.items`` is None) names them
    only in its origin (:func:`legacy_origin_items`).
    """
    items = record.items
    if items is None:
        items = legacy_origin_items(record.origin, record.cursor.epoch)
    return to_state(job, spec, record.cursor, items, record.origin or None, record.amendments,
                    Taken(record.step, record.generation))


def legacy_origin_items(origin: Any, epoch: int) -> int | None:
    """The item count an origin ``incarnation/epoch/items`` names for `epoch`, or None.

    NOTE: legacy only. Before checkpoints carried their items as a field, the origin string was
    where they were written: a format-2 state, and a coordinator's record journaled before
    ``CheckpointRecorded`` had ``items``. Nothing else reads an origin's parts: what is written now
    names its items, step and generation in fields of their own.
    """
    if not isinstance(origin, str):
        return None
    parts = origin.rsplit("/", 2)
    try:
        at, items = int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        return None
    return items if at == epoch and items >= 0 else None


def _reader_group_hint(spec: Spec, fingerprint: object) -> str:
    """For a shard order: the reader group a state was saved with, when only that differs (it defaults to
    the ranks of a node, which a job resumed on other nodes may not have); else ''."""
    if spec.shards is None:
        return ""
    for group in range(1, 1025):
        if group != spec.reader_group and dataclasses.replace(spec, reader_group=group).fingerprint == fingerprint:
            return (f"; the state was saved with reader_group={group} (this job has {spec.reader_group}, by default the "
                    f"ranks of a node, LOCAL_WORLD_SIZE): pass reader_group={group} to the sampler to resume it")
    return ""


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
