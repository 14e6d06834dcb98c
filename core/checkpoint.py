"""The checkpoint state: a small, versioned, topology-free dict naming a position in a job's data order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from croupier.core.errors import FailedPrecondition, InvalidArgument
from croupier.core.order import Cursor, validate_cursor
from croupier.core.spec import Spec

VERSION = 1
_KEYS = {"version", "job", "fingerprint", "epoch", "remaining", "base_world"}
#: Keys a state may carry beyond the cursor: ``origin`` names the checkpoint for the audit log.
_OPTIONAL = {"origin"}


def to_state(job: str, spec: Spec, cursor: Cursor) -> dict[str, Any]:
    """The checkpoint state of `job` at `cursor`: what a sampler's ``state_dict()`` returns.

    It names positions of the epoch's order, not per-rank lists, so it loads under any world
    size; it holds one interval for strided partitions and at most one per rank otherwise.
    """
    return {
        "version": VERSION,
        "job": job,
        "fingerprint": spec.fingerprint,
        "epoch": cursor.epoch,
        "remaining": [[a, b] for a, b in cursor.remaining],
        "base_world": cursor.base_world,
    }


def from_state(job: str, spec: Spec, state: Mapping[str, Any]) -> Cursor | None:
    """Reads a checkpoint state for `job` with `spec`; an empty mapping means "no state" (None).

    Raises:
        InvalidArgument: the state is malformed (missing keys, wrong types, bad intervals).
        FailedPrecondition: the state belongs to another job, another spec, or a newer version.
    """
    if not isinstance(state, Mapping):
        raise InvalidArgument(f"checkpoint state must be a dict (got {type(state).__name__})")
    if not state:
        return None
    missing = sorted(_KEYS - set(state))
    unknown = sorted(set(state) - _KEYS - _OPTIONAL)
    if missing or unknown:
        raise InvalidArgument(f"checkpoint state has missing keys {missing} and unknown keys {unknown} (got {dict(state)!r})")
    if state["version"] != VERSION:
        raise FailedPrecondition(f"checkpoint state version {state['version']!r} is not supported (this croupier reads version {VERSION})")
    if state["job"] != job:
        raise FailedPrecondition(f"checkpoint state is from job {state['job']!r}, not from this job {job!r}")
    if state["fingerprint"] != spec.fingerprint:
        raise FailedPrecondition(
            f"checkpoint state was saved with spec fingerprint {state['fingerprint']!r}, but this job's spec "
            f"has fingerprint {spec.fingerprint!r} ({spec.describe()})"
        )
    try:
        remaining = tuple(tuple(iv) for iv in state["remaining"])  # type: ignore[misc]
        cursor = Cursor(epoch=state["epoch"], remaining=remaining, base_world=state["base_world"])
        if not isinstance(cursor.base_world, int) or isinstance(cursor.base_world, bool):
            raise ValueError(f"base_world must be an int (got {cursor.base_world!r})")
        validate_cursor(spec, cursor)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"checkpoint state is malformed: {e}") from None
    return cursor
